"""The figure of a comparison: ``comparison.png``, the per-round curves of the client mean per method."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

BAND_NOTE = "line: mean over seeds; band: ± 1 std (ddof=1)"


def plot_curves(comparison: Mapping[str, Any], path: Path) -> bool:
    """``comparison.png``: per method the client mean of the metric per round, mean over seeds with a ± std band.

    Returns:
        Whether a figure was written (False when no run has per-round evaluations in ``rounds.csv``).
    """
    curves = {m: e["curve"] for m, e in comparison["methods"].items() if e["curve"]}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only; needs no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metric = comparison["metric"]
    models = {c["model"] for c in curves.values()}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, c in curves.items():
        seeds = len(comparison["methods"][method]["seeds"])
        label = f"{method} ({seeds} seed{'s' if seeds != 1 else ''})"
        if len(models) > 1:
            label += f", {c['model']} model"
        (line,) = ax.plot(c["rounds"], c["mean"], marker="o", markersize=3, label=label)
        band = [(r, m, s) for r, m, s in zip(c["rounds"], c["mean"], c["std"]) if s is not None]
        if band:
            rounds, means, stds = zip(*band)
            lower = [m - s for m, s in zip(means, stds)]
            upper = [m + s for m, s in zip(means, stds)]
            ax.fill_between(rounds, lower, upper, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    model = next(iter(models)) if len(models) == 1 else "global or personal"
    ax.set_ylabel(f"test {metric} ({model} model, mean over clients)")
    ax.set_title(f"test {metric} per round")
    ax.grid(alpha=0.3)
    ax.legend(title=BAND_NOTE, fontsize="small", title_fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
