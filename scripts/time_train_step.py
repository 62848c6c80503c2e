"""Seconds per training step of a recipe, measured on the real trainer: resumes RUN_DIR (a copy of a run's
`state/` and `tokenizer/`) for N steps and prints the mean. The run's state advances, so time a copy.

    python scripts/time_train_step.py tiny-r1 /tmp/copy_of_a_tiny_r1_run 60
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from mtp_factory import trainer
from mtp_factory.recipes import RECIPES

if len(sys.argv) != 4 or sys.argv[1] not in RECIPES:
    sys.exit("usage: time_train_step.py RECIPE RUN_DIR STEPS   (RECIPE: one of mtp_factory.recipes.RECIPES)")
recipe, run, steps = RECIPES[sys.argv[1]], Path(sys.argv[2]), int(sys.argv[3])
state = run / "state" / "state.json"
if not state.is_file():
    sys.exit(f"error: {state} is missing; copy a run's state/ and tokenizer/ into {run} first")
start = json.loads(state.read_text())["step"]
t0 = time.perf_counter()
trainer.train(recipe, run, max_steps=start + steps, echo=lambda _: None)
dt = time.perf_counter() - t0
print(f"{recipe.name}: {steps} steps from {start} in {dt:.1f} s, {dt / steps:.3f} s/step")
