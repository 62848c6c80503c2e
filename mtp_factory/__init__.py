"""The factory of the shipped model (`mtp_core/assets/tiny-r1`): what `mtp train --recipe tiny-r1` runs.

- `data/`: the generated training data (reasoning traces of nine task families, drills, standard-library
  text) and the held-out sets written beside the model;
- `recipes.py`: the shipped recipe `tiny-r1` (every setting of its 26,100 steps) and `smoke` (seconds);
- `trainer.py`: joint training of the main model and its MTP modules, resumable, exported in Hugging Face
  layout;
- `model_card.py`: the loss curves of the model card.

It imports the engine (`mtp_core`); the engine never imports it. Recipes and trace styles of earlier
models live in git history (`mtp_core/assets/tiny-r1/HISTORY.md`).
"""
