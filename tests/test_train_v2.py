"""tiny-r1 v2 training settings: the constant/linear LR segments, MTP losses on part of the batch, bf16
autocast (deterministic and resumable like the float32 path), and the recipe's architecture constraints."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from mtp_factory.recipes import RECIPES
from mtp_factory.trainer import lr_at, train


def test_constant_then_linear_lr_segments() -> None:
    r = replace(RECIPES["smoke"], warmup_steps=10, lr_segments=((100, "constant", 1e-3), (150, "linear", 1e-3, 1e-4)))
    assert math.isclose(lr_at(r, 0), 1e-4) and math.isclose(lr_at(r, 9), 1e-3)
    assert math.isclose(lr_at(r, 50), 1e-3) and math.isclose(lr_at(r, 99), 1e-3)
    assert math.isclose(lr_at(r, 100), 1e-3) and math.isclose(lr_at(r, 125), 5.5e-4)
    assert math.isclose(lr_at(r, 149), 1e-3 + (1e-4 - 1e-3) * 49 / 50)


def test_autocast_and_partial_mtp_batch_are_deterministic_and_resumable(tmp_path: Path) -> None:
    recipe = replace(RECIPES["smoke"], steps=3, save_every=1, batch_size=4, autocast_bf16=True,
                     mtp_batch_fraction=0.5)
    a, b = tmp_path / "a", tmp_path / "b"
    train(recipe, a, max_steps=2, echo=lambda s: None)
    train(recipe, a, echo=lambda s: None)
    b.mkdir()
    (b / "tokenizer").mkdir()
    for f in (a / "tokenizer").iterdir():
        (b / "tokenizer" / f.name).write_bytes(f.read_bytes())
    train(recipe, b, echo=lambda s: None)
    ha = json.loads((a / "state" / "state.json").read_text())["history"]
    hb = json.loads((b / "state" / "state.json").read_text())["history"]
    assert [x["loss"] for x in ha] == [x["loss"] for x in hb] and all(math.isfinite(x["loss"]) for x in ha)
    assert all(len(x["mtp_loss"]) == 3 and len(x["eagle_loss"]) == 2 for x in ha)


def test_v2_recipe_keeps_the_deepseek_v3_shape() -> None:
    r = RECIPES["tiny-r1"]
    cfg = r.model_config(1024, 1, 2)
    assert cfg["q_lora_rank"] and cfg["n_routed_experts"] >= 8 and cfg["n_group"] > 1 and cfg["topk_group"] >= 1
    assert cfg["n_shared_experts"] == 1 and cfg["first_k_dense_replace"] == 1
    assert cfg["num_nextn_predict_layers"] == 3 and r.eagle_depth == 3
    assert r.lr_segments[-1][0] == r.steps


def test_loss_curve_smoothing_is_a_trailing_mean() -> None:
    from mtp_factory.model_card import running_mean, smoothed_history

    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert running_mean([2.0, 4.0], 1) == [2.0, 4.0]
    hist = [{"step": i + 1, "main_loss": 1.0 + i % 2, "mtp_loss": [1.0, 2.0, 3.0], "eagle_loss": [1.0, 2.0],
             "mtp_acc": [0.5, 0.5, 0.5], "eagle_acc": [0.5, 0.5]} for i in range(300)]
    smooth, window = smoothed_history(hist)
    assert window == 3 and hist[1]["main_loss"] == 2.0                      # the input is not modified
    assert smooth[1]["main_loss"] == 1.5 and abs(smooth[4]["main_loss"] - 4 / 3) < 1e-12 and abs(smooth[5]["main_loss"] - 5 / 3) < 1e-12
    assert smooth[-1]["mtp_loss"] == [1.0, 2.0, 3.0] and smooth[-1]["step"] == 300
