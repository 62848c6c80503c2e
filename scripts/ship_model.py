"""Copy a finished `mtp train` run into the package (mtp_core/assets/<recipe>) with its eval directory (the
held-out sets, the general-text prompts, sets.json) and loss curves. The model card beside it is written
from the measured numbers.

    python scripts/ship_model.py runs/tiny-r1
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from mtp_factory.data import write_shipped_eval
from mtp_factory.model_card import load_history, plot_loss_curves

run = Path(sys.argv[1])
recipe = json.loads((run / "recipe.json").read_text())["name"]
dest = Path(__file__).resolve().parent.parent / "mtp_core" / "assets" / recipe
dest.mkdir(parents=True, exist_ok=True)
for f in (run / "model").iterdir():
    shutil.copy(f, dest / f.name)
shutil.copy(run / "recipe.json", dest / "recipe.json")
write_shipped_eval(dest / "eval")
history = load_history(run)
plot_loss_curves(history, dest / "loss_curves.png")
print(f"shipped {recipe} to {dest}: {len(history)} steps, final loss {history[-1]['loss']:.3f}")
