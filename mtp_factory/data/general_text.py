"""General (non-chat) training text: source and docstrings of a fixed list of standard-library modules.

The text is read from the files of the running interpreter's standard library, so it is available
offline everywhere, and is the same on every machine with the same Python minor version (the files
differ a little between versions; `fingerprint()` identifies the exact text used). License of this
text: the Python Software Foundation License (PSF-2.0), which permits copying and derived works.
"""
from __future__ import annotations

import functools
import hashlib
import sys
import sysconfig
from pathlib import Path

from mtp_core.chat_format import BOS

LICENSE = "PSF-2.0 (Python Software Foundation License), text of the Python standard library"

# Fixed, ordered list (paths under the stdlib directory, without '.py'); about 1 MB of text.
STDLIB_MODULES: tuple[str, ...] = (
    "textwrap", "string", "heapq", "bisect", "fractions", "statistics", "calendar", "difflib", "shlex",
    "fnmatch", "glob", "colorsys", "queue", "sched", "functools", "dataclasses", "enum", "contextlib",
    "abc", "copy", "pprint", "reprlib", "graphlib", "numbers", "operator", "random", "base64", "csv",
    "argparse", "json/__init__", "json/decoder", "json/encoder", "collections/__init__", "shutil",
    "datetime", "ipaddress", "configparser", "pathlib", "tempfile", "timeit",
)
_MIN_MODULES = len(STDLIB_MODULES) // 2


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _split(text: str, target_chars: int, max_chars: int) -> list[str]:
    """Cut at line ends into chunks of about `target_chars` (a single long line is cut hard)."""
    chunks, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:
            chunks.append(line[:max_chars])
            line = line[max_chars:]
        current.append(line)
        size += len(line)
        if size >= target_chars:
            chunks.append("".join(current))
            current, size = [], 0
    if "".join(current).strip():
        chunks.append("".join(current))
    return [c for c in chunks if c.strip()]


@functools.lru_cache(maxsize=4)
def load_chunks(target_chars: int = 1000, max_chars: int = 2000) -> tuple[str, ...]:
    """The chunks of every module in `STDLIB_MODULES` that exists here, in list order."""
    if not 0 < target_chars <= max_chars:
        raise ValueError(f"need 0 < target_chars <= max_chars, got {target_chars} and {max_chars}")
    root, chunks, found = stdlib_dir(), [], 0
    for name in STDLIB_MODULES:
        path = root / f"{name}.py"
        if path.is_file():
            found += 1
            chunks += _split(path.read_text(encoding="utf-8"), target_chars, max_chars)
    if found < _MIN_MODULES:
        raise ValueError(f"found only {found} of {len(STDLIB_MODULES)} standard-library sources under "
                         f"{root}; use a Python installation that ships its .py files")
    return tuple(chunks)


def render_general(chunk: str) -> str:
    """A general-text training string: BOS, then plain text (no chat markers, no EOS: it is cut mid-file)."""
    return BOS + chunk


def fingerprint() -> str:
    """Python version plus a short hash of the exact general text, for the model card."""
    digest = hashlib.sha256("\x00".join(load_chunks()).encode()).hexdigest()[:16]
    return f"python{sys.version_info.major}.{sys.version_info.minor}-{digest}"
