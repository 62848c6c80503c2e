"""Copy a finished `mtp train` run into the package (mtp_core/assets/<recipe>) with its held-out eval
sets and loss curves. The model card beside it is written from the measured numbers.

    python scripts/ship_model.py runs/tiny-r1
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from mtp_core.data import write_eval_sets
from mtp_core.train.model_card import load_history, plot_loss_curves

run = Path(sys.argv[1])
recipe = json.loads((run / "recipe.json").read_text())["name"]
dest = Path(__file__).resolve().parent.parent / "mtp_core" / "assets" / recipe
dest.mkdir(parents=True, exist_ok=True)
for f in (run / "model").iterdir():
    shutil.copy(f, dest / f.name)
shutil.copy(run / "recipe.json", dest / "recipe.json")
write_eval_sets(dest / "eval", per_family=50, seed=1234)
history = load_history(run)
plot_loss_curves(history, dest / "loss_curves.png")
print(f"shipped {recipe} to {dest}: {len(history)} steps, final loss {history[-1]['loss']:.3f}")
