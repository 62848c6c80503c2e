"""The shipped model's held-out prompts, as the factory wrote them beside it (`assets/tiny-r1/eval/`).

- `eval_<set>.jsonl`: one file per task family and per target set (`add_3digit`), `per_set` records each
  (`task`, `question`, `prompt`: chat-rendered with BOS, `answer`), never trained on. A set is drawn in a
  fixed order, so its first n records are the set of n.
- `general.jsonl`: chunks of Python standard-library source (`{"task": "general", "prompt": chunk}`), the
  general-text prompts.
- `sets.json`: the families and the target sets in order, the seed and size the sets were drawn with, and
  the fingerprint of the general text.

`mtp prepare-dataset`, `mtp sweep` (with `--accuracy`) and the evaluation scripts read their prompts here.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

EVAL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-r1" / "eval"


@dataclass(frozen=True)
class EvalSets:
    """sets.json: what the eval directory holds."""
    families: tuple[str, ...]       # task families, in the order the bench round-robins over them
    target_sets: tuple[str, ...]    # sets beside the families (each a family's questions of one kind)
    seed: int                       # the seed the sets were drawn with
    per_set: int                    # records per eval_<set>.jsonl
    general_text: str               # the general text's fingerprint (Python version + hash)

    @property
    def names(self) -> tuple[str, ...]:
        return self.families + self.target_sets


def read_manifest(eval_dir: Path = EVAL_DIR) -> EvalSets:
    path = Path(eval_dir) / "sets.json"
    if not path.is_file():
        raise ValueError(f"{path} not found; the shipped model's eval directory is incomplete (reinstall the package)")
    d = json.loads(path.read_text(encoding="utf-8"))
    return EvalSets(tuple(d["families"]), tuple(d["target_sets"]), int(d["seed"]), int(d["per_set"]),
                    d["general_text"])


def load_eval_set(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file (only "\\n" ends a line: JSON text may hold U+2028)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line.strip()]


def eval_records(name: str, count: int, eval_dir: Path = EVAL_DIR) -> list[dict]:
    """The first `count` held-out records of the family or target set `name`."""
    sets = read_manifest(eval_dir)
    if name not in sets.names:
        raise ValueError(f"unknown eval set {name!r}; use one of {', '.join(sets.names)}")
    if not 1 <= count <= sets.per_set:
        raise ValueError(f"{count} held-out {name} questions asked for; between 1 and {sets.per_set} ship with the "
                         "model")
    return load_eval_set(Path(eval_dir) / f"eval_{name}.jsonl")[:count]


def accuracy_records(per_set: int, eval_dir: Path = EVAL_DIR) -> list[dict]:
    """`per_set` records of every family, then of every target set: the questions accuracy is scored on."""
    return [r for name in read_manifest(eval_dir).names for r in eval_records(name, per_set, eval_dir)]


@functools.cache
def general_chunks(eval_dir: Path = EVAL_DIR) -> tuple[str, ...]:
    """The general-text chunks, in the order the factory wrote them (read once per process: 1.3 MB)."""
    return tuple(r["prompt"] for r in load_eval_set(Path(eval_dir) / "general.jsonl"))
