"""PNG figures of a run: learning curves and the partition of the data over clients."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_curves(client_rows: list[dict[str, Any]], path: Path, metric: str = "acc") -> bool:
    """Per-client (thin) and mean (thick) test ``metric`` per round, one panel per evaluated model.

    Args:
        client_rows: The rows of ``metrics.csv`` (``round``, ``client``, ``global/acc``, ``personal/acc``, …).
        path: Output PNG.
        metric: Metric name without the model prefix.

    Returns:
        Whether a figure was written (False if no round was evaluated yet).

    """
    models = [m for m in ("global", "personal") if any(_num(r.get(f"{m}/{metric}")) is not None for r in client_rows)]
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for row in client_rows:
            value = _num(row.get(f"{model}/{metric}"))
            if value is not None:
                series[str(row["client"])].append((int(row["round"]), value))
        for cid, points in sorted(series.items()):
            ax.plot(*zip(*points), lw=1, alpha=0.6, label=cid)
        by_round: dict[int, list[float]] = defaultdict(list)
        for points in series.values():
            for r, v in points:
                by_round[r].append(v)
        rounds = sorted(by_round)
        ax.plot(rounds, [np.mean(by_round[r]) for r in rounds], "k-", lw=2.5, label="mean")
        ax.set_title(f"{model} model: test {metric} per client")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric)
    axes[0][-1].legend(fontsize=7, ncol=2 if len(series) > 8 else 1, loc="lower right")
    _save(fig, path)
    return True


def plot_partition(
    label_counts: dict[str, np.ndarray],
    path: Path,
    domain_counts: dict[str, np.ndarray] | None = None,
    label_unit: str = "samples",
) -> None:
    """Stacked bars of each client's training labels (and sites/domains, when known).

    Args:
        label_counts: ``{client: counts per class}``.
        path: Output PNG.
        domain_counts: ``{client: counts per domain}`` (images) or None.
        label_unit: What ``label_counts`` counts: ``samples``, or ``pixels`` for segmentation masks.

    """
    _save(partition_figure(label_counts, domain_counts, label_unit), path)


def partition_figure(
    label_counts: dict[str, np.ndarray], domain_counts: dict[str, np.ndarray] | None, label_unit: str
) -> plt.Figure:
    """The figure of :func:`plot_partition`."""
    panels = [("class", label_counts, label_unit)]
    if domain_counts:
        panels.append(("site / domain", domain_counts, "samples"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (name, counts, unit) in zip(axes[0], panels):
        clients = list(counts)
        matrix = np.stack([np.asarray(counts[c], dtype=float) for c in clients])
        bottom = np.zeros(len(clients))
        cmap = plt.get_cmap("tab10" if matrix.shape[1] <= 10 else "tab20")
        for k in range(matrix.shape[1]):
            ax.bar(clients, matrix[:, k], bottom=bottom, color=cmap(k % cmap.N), label=str(k))
            bottom += matrix[:, k]
        ax.set_title(f"training {unit} per client, by {name}")
        ax.tick_params(axis="x", rotation=45 if len(clients) > 6 else 0)
        ax.legend(title=name, fontsize=7, ncol=1 + matrix.shape[1] // 10, loc="upper right")
    return fig


def plot_node_matrix(matrix: dict[str, dict[str, dict[str, Any]]], path: Path, metric: str = "acc") -> None:
    """Heat map of each node's model (rows) on each node's test set (columns).

    Args:
        matrix: ``{holder: {test node: {metric: value}}}`` (values may be None when undefined).
        path: Output PNG.
        metric: The metric to show.

    """
    nodes = list(matrix)
    values = np.array([[_num(matrix[h][t].get(metric)) or np.nan for t in nodes] for h in nodes], dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 * len(nodes) + 2, 1.0 * len(nodes) + 1.5))
    image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis")
    for i in range(len(nodes)):
        for j in range(len(nodes)):
            ax.text(j, i, f"{values[i, j]:.3f}", ha="center", va="center", color="w" if values[i, j] < 0.6 else "k")
    ax.set_xticks(range(len(nodes)), nodes, rotation=45 if len(nodes) > 5 else 0)
    ax.set_yticks(range(len(nodes)), nodes)
    ax.set_xlabel("test set of node")
    ax.set_ylabel("model held by node")
    ax.set_title(f"test {metric}: every node's model on every node's data")
    fig.colorbar(image, ax=ax)
    _save(fig, path)


def _num(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) else out


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
