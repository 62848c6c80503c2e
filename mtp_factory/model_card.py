"""Model-card artefacts from a training run's history: the loss curves (PNG) beside the card."""
from __future__ import annotations

import json
from pathlib import Path


def running_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start): per-step losses of a 4-row batch
    are too noisy to read over thousands of steps."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothed_history(history: list[dict]) -> tuple[list[dict], int]:
    """A copy of the history with every loss and accuracy a trailing mean over 1% of the run (>= 1 step)."""
    window = max(1, len(history) // 100)
    out = [dict(h) for h in history]
    for key in ("main_loss", "mtp_loss", "eagle_loss", "mtp_acc", "eagle_acc"):
        if isinstance(out[0][key], list):
            cols = [running_mean([h[key][d] for h in history], window) for d in range(len(history[0][key]))]
            for i, h in enumerate(out):
                h[key] = [c[i] for c in cols]
        else:
            for h, v in zip(out, running_mean([h[key] for h in history], window)):
                h[key] = v
    return out, window


def plot_loss_curves(history: list[dict], out_png: Path) -> None:
    """Main loss, MTP losses per depth (Vanilla chain) and Eagle-chain losses against the step, smoothed
    (`smoothed_history`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history, window = smoothed_history(history)
    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [h["main_loss"] for h in history], label="main LM loss")
    for d in range(len(history[0]["mtp_loss"])):
        ax1.plot(steps, [h["mtp_loss"][d] for h in history], label=f"MTP module {d + 1} (depth {d + 1})")
    for d in range(len(history[0]["eagle_loss"])):
        ax1.plot(steps, [h["eagle_loss"][d] for h in history], "--", label=f"module 1 reused, depth {d + 2}")
    ax1.set_xlabel(f"step (trailing mean over {window} steps)" if window > 1 else "step")
    ax1.set_ylabel("cross-entropy")
    ax1.set_yscale("log")
    ax1.legend(fontsize=7)
    for d in range(len(history[0]["mtp_acc"])):
        ax2.plot(steps, [h["mtp_acc"][d] for h in history], label=f"Vanilla depth {d + 1}")
    for d in range(len(history[0]["eagle_acc"])):
        ax2.plot(steps, [h["eagle_acc"][d] for h in history], "--", label=f"Eagle depth {d + 2}")
    ax2.set_xlabel("step")
    ax2.set_ylabel("teacher-forced top-1 accuracy of the draft")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def load_history(run_dir: Path) -> list[dict]:
    """The per-step history of a `mtp train --out` directory's saved state."""
    return json.loads((run_dir / "state" / "state.json").read_text())["history"]
