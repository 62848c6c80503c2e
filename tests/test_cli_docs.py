"""The docs stay true: docs/cli.md's tables are the commands' and the schema's, and every example runs.

docs/cli.md holds three generated parts, each between markers: the quickstart flag table (from the command's
signature), every command's options (from its `--help`: the click parameters) and the compatibility table
(mtp_core/config/compat.py). Regenerate them with `python tests/test_cli_docs.py` (it rewrites docs/cli.md).
Examples: every fenced ```bash block of README.md and docs/*.md whose first line is `# test` (exit 0 expected)
or `# test: exit N` runs as one bash script (`set -eo pipefail`) in a fresh directory holding a copy of
extra-llm-api-config.yml, with `DIR` replaced by a tiny checkpoint and `mtp` meaning this repository's CLI.
"""
from __future__ import annotations

import enum
import inspect
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "cli.md"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]     # pages whose examples run
BLOCK = re.compile(r"```bash\n# test(?::\s*exit\s+(\d+))?\n(.*?)```", re.S)
TABLE = re.compile(r"<!-- flags:begin -->\n(.*?)<!-- flags:end -->", re.S)
COMMANDS = re.compile(r"<!-- commands:begin -->\n(.*?)<!-- commands:end -->", re.S)
COMPAT = re.compile(r"<!-- compat:begin -->\n(.*?)<!-- compat:end -->", re.S)


def _value_kind(hint: typing.Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        return _value_kind(args[0])
    if typing.get_origin(hint) is list:
        return _value_kind(args[0]) + " ..."
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " \\| ".join(m.value for m in hint)
    return {bool: "", int: "INT", float: "FLOAT", str: "TEXT", Path: "PATH"}[hint]


def _default(value: typing.Any, hint: typing.Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return ""
    if hint is bool:
        return "on" if value else "off"
    return f"`{value}`"


def flag_table() -> str:
    """The markdown table of `mtp quickstart`'s flags, from the command's own signature."""
    from cli.quickstart import quickstart_command

    hints = typing.get_type_hints(quickstart_command)
    rows = ["| Flag | Value | Default | Meaning |", "|---|---|---|---|"]
    for name, param in inspect.signature(quickstart_command).parameters.items():
        info = param.default
        if name == "ctx":
            continue
        flags = ", ".join(f"`{d}`" for d in info.param_decls)
        meaning = re.sub(r"(</?[a-z]+>)", r"`\1`", info.help).replace("|", "\\|")
        rows.append(f"| {flags} | {_value_kind(hints[name])} | {_default(info.default, hints[name])} | {meaning} |")
    return "\n".join(rows) + "\n"


def command_reference() -> str:
    """Every command but quickstart (whose table is flag_table()): its help line, then each argument and option
    as `mtp COMMAND --help` shows it (the real app's help records)."""
    import typer.main

    from cli.app import app

    group = typer.main.get_command(app)
    out = []
    for name in sorted(group.commands):
        if name == "quickstart":
            continue
        cmd = group.commands[name]
        ctx = cmd.make_context(name, [], resilient_parsing=True)
        out += [f"### `mtp {name}`", "", (cmd.help or "").strip(), "", "| Argument / option | Meaning |", "|---|---|"]
        for p in cmd.params:
            record = p.get_help_record(ctx)
            if record is None:
                continue
            usage, meaning = record
            meaning = re.sub(r"\s+", " ", meaning).replace("|", "\\|")
            out.append(f"| `{usage}` | {meaning} |")
        out.append("")
    return "\n".join(out)


def compat_table() -> str:
    from mtp_core.config import LLMConfig
    from mtp_core.config.compat import markdown
    from mtp_core.config.schema import entries

    return markdown({e.name for e in entries(LLMConfig) if e.spec.yaml}).rstrip("\n") + "\n"


GENERATED = [(TABLE, "flags", flag_table), (COMMANDS, "commands", command_reference), (COMPAT, "compat", compat_table)]


@pytest.mark.parametrize("pattern,name,make", GENERATED, ids=[g[1] for g in GENERATED])
def test_generated_tables_are_current(pattern, name, make) -> None:
    m = pattern.search(DOC.read_text(encoding="utf-8"))
    assert m, f"docs/cli.md lost its <!-- {name}:begin --> ... <!-- {name}:end --> markers"
    assert m.group(1) == make(), f"docs/cli.md's {name} table is stale: run `python tests/test_cli_docs.py`"


def test_help_shows_every_documented_flag() -> None:
    from typer.testing import CliRunner

    from cli.app import app

    r = CliRunner().invoke(app, ["quickstart", "--help"], env={"COLUMNS": "300"})   # the real app, in-process
    assert r.exit_code == 0, r.output
    table = TABLE.search(DOC.read_text(encoding="utf-8")).group(1)
    flags = re.findall(r"`(--[a-z_]+)`", table)
    assert len(flags) > 30
    missing = [f for f in flags if not re.search(re.escape(f) + r"\b", r.output)]
    assert not missing, missing


def test_every_yaml_key_is_documented() -> None:
    from mtp_core.yaml_config import valid_yaml_keys

    doc = DOC.read_text(encoding="utf-8")
    tree = valid_yaml_keys()
    deprecated = tree.pop("pytorch_backend_config")
    for old in deprecated:
        tree.pop(old, None)
    paths = [k for k in tree] + [f"{k}.{sub}" for k, v in tree.items() if isinstance(v, dict) for sub in v]
    missing = [p for p in paths if f"| `{p}` |" not in doc]            # a row of the key table
    missing += [old for old in ["pytorch_backend_config", *deprecated] if f"`{old}`" not in doc]
    assert not missing, missing


def doc_examples() -> list[tuple[int, str]]:
    return [(int(code or 0), body) for page in PAGES if page.is_file()
            for code, body in BLOCK.findall(page.read_text(encoding="utf-8"))]


@pytest.fixture(scope="module")
def example_env(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    from mtp_core.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("docs")
    ckpt = make_tiny_checkpoint(root / "ckpt", num_mtp=1, num_layers=2, seed=11)
    bindir = root / "bin"
    bindir.mkdir()
    (bindir / "mtp").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cli "$@"\n')
    (bindir / "mtp").chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": f"{bindir}:{os.environ['PATH']}"}
    return ckpt, env


def test_docs_have_examples() -> None:
    codes = [code for code, _ in doc_examples()]
    assert len(codes) >= 5 and 0 in codes and 2 in codes


@pytest.mark.parametrize("index", range(len(doc_examples())))
def test_doc_example_runs(index: int, example_env, tmp_path: Path) -> None:
    ckpt, env = example_env
    code, body = doc_examples()[index]
    shutil.copy(REPO / "extra-llm-api-config.yml", tmp_path)
    script = "set -eo pipefail\n" + re.sub(r"\bDIR\b", str(ckpt), body)
    if "mtp serve" in body:                  # the server example: a free port instead of 8000
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            script = re.sub(r"\b8000\b", str(sock.getsockname()[1]), script)
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == code, f"example {index} exited {r.returncode}, expected {code}\n{body}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    text = DOC.read_text(encoding="utf-8")
    for pattern, name, make in GENERATED:
        text = pattern.sub(lambda m, name=name, make=make: f"<!-- {name}:begin -->\n{make()}<!-- {name}:end -->", text)
    DOC.write_text(text, encoding="utf-8")
    print(f"rewrote the generated tables of {DOC.relative_to(REPO)}")
