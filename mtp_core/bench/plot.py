"""Figures of the write-up: 7 (AL and speed-up against K per drafting mode) and 8 (accuracy, strict vs
relaxed acceptance). matplotlib is an optional extra: `pip install matplotlib` (or `.[plot]`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib, which is not installed; run `pip install matplotlib` "
                         "(or `pip install -e '.[plot]'`), or pass --no_plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_sweep(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """rows: sweep table rows (mode, K, acceptance_length, speedup). Relaxed rows are drawn as single markers."""
    plt = require_matplotlib()
    fig, (ax_al, ax_sp) = plt.subplots(1, 2, figsize=(10, 4))
    modes = sorted({r["mode"] for r in rows if r["K"] > 0 and not r["relaxed"]})
    base = [r for r in rows if r["K"] == 0]
    for mode in modes:
        pts = base + sorted((r for r in rows if r["mode"] == mode and not r["relaxed"] and not r.get("adaptive")),
                            key=lambda r: r["K"])
        ax_al.plot([r["K"] for r in pts], [r["acceptance_length"] for r in pts], marker="o", label=mode)
        ax_sp.plot([r["K"] for r in pts], [r["speedup"] for r in pts], marker="o", label=mode)
    for r in rows:
        if r["relaxed"]:
            ax_al.scatter([r["K"]], [r["acceptance_length"]], marker="*", s=140, color="C3", label=r["label"])
            ax_sp.scatter([r["K"]], [r["speedup"]], marker="*", s=140, color="C3", label=r["label"])
        elif r.get("adaptive"):     # drawn at its mean drafts per step
            x = r.get("mean_drafts_per_step") or r["K"]
            ax_al.scatter([x], [r["acceptance_length"]], marker="D", s=60, label=r["label"])
            ax_sp.scatter([x], [r["speedup"]], marker="D", s=60, label=r["label"])
    ax_al.set(xlabel="draft tokens K (nextn)", ylabel="acceptance length (tokens/step)", title="Acceptance length")
    ax_sp.set(xlabel="draft tokens K (nextn)", ylabel="speed-up over nextn=0 (tokens/s/user)", title="Speed-up")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_al, ax_sp):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def plot_accuracy(accuracy: dict[str, dict[str, float]], path: str | Path, title: str = "") -> Path:
    """accuracy: {"strict": {task: acc}, "relaxed": {task: acc}} -> grouped bars per task set."""
    plt = require_matplotlib()
    tasks = list(accuracy["strict"])
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(tasks) + 2), 4))
    width = 0.38
    xs = range(len(tasks))
    for shift, key in ((-width / 2, "strict"), (width / 2, "relaxed")):
        ax.bar([x + shift for x in xs], [100 * accuracy[key].get(t, 0.0) for t in tasks], width, label=key)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(tasks, rotation=30, ha="right")
    ax.set(ylabel="exact match (%)", title=title or "Accuracy: strict vs relaxed acceptance", ylim=(0, 105))
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    """Lay out, write the PNG (creating its folder) and free the figure."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
