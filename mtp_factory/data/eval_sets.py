"""The shipped model's held-out evaluation sets, written once into its eval directory (the product reads
them with `mtp_core.bench.eval_sets`).

Each family's set is drawn only from the held-out share of its operand space (`tasks.split_of`), so it is
never trained on; a target set holds one kind of a family's questions (`add_3digit`: both operands 3
digits). The general-text prompts are the standard-library chunks the training mix uses. `sets.json`
names the sets in order, so the product needs no list of families of its own.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from mtp_factory.data import general_text
from mtp_factory.data.dataset import FAMILIES, example_for
from mtp_factory.data.tasks import FAMILY_SPECS, check_family, sample_operands, split_of

# Target sets beside the families: (file stem / task name, family, operand digits).
TARGET_SETS = (("add_3digit", "add", 3),)
# What the shipped model's eval directory holds: 50 questions per set, drawn with seed 1234.
SHIPPED_PER_SET, SHIPPED_SEED = 50, 1234


def generate_eval_records(family: str, per_family: int = SHIPPED_PER_SET, seed: int = SHIPPED_SEED,
                          operand_digits: int | None = None, task: str | None = None) -> list[dict]:
    """`per_family` distinct held-out questions of `family` (distinct canonical operands); with
    `operand_digits`, only questions whose integer operands all have that many digits (records then carry
    `task`, e.g. "add_3digit")."""
    check_family(family)
    if per_family < 1:
        raise ValueError(f"per_family must be >= 1, got {per_family}")
    rng = random.Random(f"eval-{seed}-{family}")
    seen: set[tuple] = set()
    records: list[dict] = []
    for _ in range(200 * per_family + 2000):
        if len(records) == per_family:
            return records
        ops = sample_operands(family, rng, "eval")
        if operand_digits is not None:
            ops = _with_digits(family, ops, operand_digits, rng)
            if ops is None:
                continue
        key = FAMILY_SPECS[family].canonical(ops)
        if key in seen:
            continue
        seen.add(key)
        ex = example_for(family, ops, rng)
        records.append({"task": task or family, "question": ex.question, "prompt": ex.prompt, "answer": ex.answer})
    raise ValueError(f"only {len(records)} distinct held-out {family} questions exist; lower per_family")




def _with_digits(family: str, ops: tuple, digits: int, rng: random.Random) -> tuple | None:
    """Held-out operands of `family` with `digits`-digit integers: redrawn until the split agrees."""
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    for _ in range(1000):
        cand = tuple(rng.randint(lo, hi) if isinstance(o, int) else o for o in ops)
        if split_of(family, cand) == "eval":
            return cand
    return None


def write_eval_sets(out_dir: Path, per_family: int = SHIPPED_PER_SET, seed: int = SHIPPED_SEED) -> list[Path]:
    """Write eval_<family>.jsonl for every family, then the TARGET_SETS (eval_add_3digit.jsonl), into
    `out_dir`; returns the paths in that order."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sets = [(family, generate_eval_records(family, per_family, seed)) for family in FAMILIES]
    sets += [(name, generate_eval_records(family, per_family, seed, digits, name))
             for name, family, digits in TARGET_SETS]
    paths = []
    for name, records in sets:
        path = out / f"eval_{name}.jsonl"
        path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def write_general_set(out_dir: Path) -> Path:
    """general.jsonl: every general-text chunk, in order, as `{"task": "general", "prompt": chunk}`."""
    path = Path(out_dir) / "general.jsonl"
    path.write_text("".join(json.dumps({"task": "general", "prompt": chunk}, ensure_ascii=False) + "\n"
                            for chunk in general_text.load_chunks()), encoding="utf-8")
    return path


def write_shipped_eval(out_dir: Path, per_family: int = SHIPPED_PER_SET, seed: int = SHIPPED_SEED) -> list[Path]:
    """The whole eval directory of a shipped model: the held-out sets (`write_eval_sets`), general.jsonl and
    sets.json; returns the paths written."""
    paths = write_eval_sets(out_dir, per_family, seed) + [write_general_set(out_dir)]
    manifest = {"families": FAMILIES, "target_sets": [name for name, _, _ in TARGET_SETS], "seed": seed,
                "per_set": per_family, "general_text": general_text.fingerprint()}
    path = Path(out_dir) / "sets.json"
    path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return paths + [path]
