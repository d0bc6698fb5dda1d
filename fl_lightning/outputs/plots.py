"""PNG figures of a run: learning curves, the partition of the data over clients and example images per client.

Up to :data:`MANY_CLIENTS` clients the figures draw one bar or line per client; beyond, distributions and heat maps
whose number of artists does not grow with the clients (a figure of 1,000 clients draws as fast as one of 50, and
stays readable). matplotlib is imported on the first figure, not with this module (a run without plots, and
``--help``, never load it).
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Above this many clients, figures show distributions and heat maps instead of one bar or line per client.
MANY_CLIENTS = 50
# Above this many bytes, a colour sites.png is written with a 256-colour palette instead of full RGB.
COMPACT_PNG_BYTES = 200_000


_PYPLOT: list[Any] = []  # pyplot, once imported


def pyplot() -> Any:
    """Matplotlib's pyplot, chosen the non-interactive Agg backend on first use (files only; needs no display)."""
    if not _PYPLOT:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        _PYPLOT.append(plt)
    return _PYPLOT[0]


def plot_curves(client_rows: list[dict[str, Any]], path: Path, metric: str = "acc") -> bool:
    """Per-client (thin) and mean (thick) test ``metric`` per round, one panel per evaluated model.

    Beyond :data:`MANY_CLIENTS` clients: the mean, the worst client and the 10–90 % and 25–75 % bands of the
    clients per round instead of one line per client.

    Args:
        client_rows: The rows of ``metrics.csv`` (``round``, ``client``, ``global/acc``, ``personal/acc``, …).
        path: Output PNG.
        metric: Metric name without the model prefix.

    Returns:
        Whether a figure was written (False if no round was evaluated yet).

    """
    fig = curves_figure(client_rows, metric)
    if fig is None:
        return False
    save_figure(fig, path)
    return True


def curve_series(client_rows: list[dict[str, Any]], model: str, metric: str) -> dict[str, list[tuple[int, float]]]:
    """``{client: [(round, value), …]}`` of ``<model>/<metric>`` over the rows that hold a number for it."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    key = f"{model}/{metric}"
    for row in client_rows:
        value = _num(row.get(key))
        if value is not None:
            series[str(row["client"])].append((int(row["round"]), value))
    return series


def by_round(series: dict[str, list[tuple[int, float]]]) -> tuple[list[int], list[np.ndarray]]:
    """The evaluated rounds in order and, per round, the values of the clients evaluated in it."""
    values: dict[int, list[float]] = defaultdict(list)
    for points in series.values():
        for r, v in points:
            values[r].append(v)
    rounds = sorted(values)
    return rounds, [np.asarray(values[r], dtype=float) for r in rounds]


def personal_repeats_global(client_rows: list[dict[str, Any]], metric: str = "acc") -> bool:
    """Whether every row's personal ``metric`` equals its global one exactly (and at least one row has one).

    The client runtime copies the global metrics into the personal ones when a client keeps nothing private
    (FedAvg): a personal panel would then repeat the global panel. Numbers are compared exactly, as written.
    """
    pairs = [(_num(r.get(f"global/{metric}")), _num(r.get(f"personal/{metric}"))) for r in client_rows]
    personal = [(g, p) for g, p in pairs if p is not None]
    return bool(personal) and all(g == p for g, p in personal)


def curves_figure(client_rows: list[dict[str, Any]], metric: str = "acc") -> Figure | None:
    """The figure of :func:`plot_curves`, or None if no round was evaluated yet.

    One panel per evaluated model (global, personal), except that the personal panel is left out when it would
    repeat the global one (:func:`personal_repeats_global`); the global panel's title then says so. Rounds are
    whole numbers, so the x axis has integer ticks only.
    """
    models = [m for m in ("global", "personal") if any(_num(r.get(f"{m}/{metric}")) is not None for r in client_rows)]
    if not models:
        return None
    same = "personal" in models and "global" in models and personal_repeats_global(client_rows, metric)
    if same:
        models.remove("personal")
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False, sharey=True)
    many = False
    for ax, model in zip(axes[0], models):
        series = curve_series(client_rows, model, metric)
        rounds, values = by_round(series)
        many = len(series) > MANY_CLIENTS
        label = "global model (= personal)" if same else f"{model} model"
        marker = "o" if len(rounds) == 1 else None  # a one-round line has no length: show its point
        if many:
            _draw_bands(ax, rounds, values, worst=np.max if metric == "loss" else np.min)
            ax.set_title(f"{label}: test {metric} over {len(series)} clients")
        else:
            for cid, points in sorted(series.items()):
                ax.plot(*zip(*points), lw=1, alpha=0.6, marker=marker, ms=3, label=cid)
            ax.set_title(f"{label}: test {metric} per client")
        ax.plot(rounds, [float(v.mean()) for v in values], "k-", lw=2.5, marker=marker, label="mean")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # 1 round: one tick
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric)
    axes[0][-1].legend(fontsize=7, ncol=2 if not many and len(series) > 8 else 1, loc="best" if many else "lower right")
    return fig


def _draw_bands(ax: Axes, rounds: list[int], values: list[np.ndarray], worst: Any) -> None:
    """Quantile bands of the clients' values per round and the worst client (a fixed number of artists)."""
    q = np.array([np.percentile(v, [10, 25, 75, 90]) for v in values])
    ax.fill_between(rounds, q[:, 0], q[:, 3], color="C0", alpha=0.2, lw=0, label="10–90 % of clients")
    ax.fill_between(rounds, q[:, 1], q[:, 2], color="C0", alpha=0.4, lw=0, label="25–75 % of clients")
    ax.plot(rounds, [float(worst(v)) for v in values], color="C3", lw=1, ls="--", label="worst client")


def plot_partition(
    label_counts: dict[str, np.ndarray],
    path: Path,
    domain_counts: dict[str, np.ndarray] | None = None,
    label_unit: str = "samples",
) -> None:
    """Stacked bars of each client's training labels (and sites/domains, when known).

    Beyond :data:`MANY_CLIENTS` clients: a heat map of each client's share of each class (site) and the
    distribution of the clients' sizes, instead of one bar per client and class (quadratic to draw).

    Args:
        label_counts: ``{client: counts per class}``.
        path: Output PNG.
        domain_counts: ``{client: counts per domain}`` (images) or None.
        label_unit: What ``label_counts`` counts: ``samples``, or ``pixels`` for segmentation masks.

    """
    save_figure(partition_figure(label_counts, domain_counts, label_unit), path)


def partition_figure(
    label_counts: dict[str, np.ndarray], domain_counts: dict[str, np.ndarray] | None, label_unit: str
) -> Figure:
    """The figure of :func:`plot_partition`."""
    panels = [("class", label_counts, label_unit)]
    if domain_counts:
        panels.append(("site / domain", domain_counts, "samples"))
    plt = pyplot()
    if len(label_counts) > MANY_CLIENTS:
        return _partition_heatmaps(plt, panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (name, counts, unit) in zip(axes[0], panels):
        clients = list(counts)
        matrix = count_matrix(counts)
        bottom = np.zeros(len(clients))
        cmap = plt.get_cmap("tab10" if matrix.shape[1] <= 10 else "tab20")
        for k in range(matrix.shape[1]):
            ax.bar(clients, matrix[:, k], bottom=bottom, color=cmap(k % cmap.N), label=str(k))
            bottom += matrix[:, k]
        ax.set_title(f"training {unit} per client, by {name}")
        ax.tick_params(axis="x", rotation=45 if len(clients) > 6 else 0)
        ax.legend(title=name, fontsize=7, ncol=1 + matrix.shape[1] // 10, loc="upper right")
    return fig


def count_matrix(counts: dict[str, np.ndarray]) -> np.ndarray:
    """``counts`` as a clients × categories float matrix, in the clients' order."""
    return np.stack([np.asarray(c, dtype=float) for c in counts.values()])


def shares(matrix: np.ndarray) -> np.ndarray:
    """Each row of ``matrix`` divided by its sum (rows without counts stay zero)."""
    totals = matrix.sum(1, keepdims=True)
    return np.divide(matrix, totals, out=np.zeros_like(matrix), where=totals > 0)


def dominant_order(share: np.ndarray) -> np.ndarray:
    """Client order for a heat map: by the category of their largest share, then by that share (largest first)."""
    top = share.argmax(1)
    return np.lexsort((-share[np.arange(len(share)), top], top))


def _partition_heatmaps(plt: Any, panels: list[tuple[str, dict[str, np.ndarray], str]]) -> Figure:
    """Many clients: per panel, each client's share of each category as one image, and the clients' sizes."""
    fig, axes = plt.subplots(
        2, len(panels), figsize=(7 * len(panels), 6), squeeze=False, gridspec_kw={"height_ratios": [3, 1.4]}
    )
    for col, (name, counts, unit) in enumerate(panels):
        matrix = count_matrix(counts)
        ax = axes[0][col]
        share = shares(matrix)
        image = ax.imshow(
            share[dominant_order(share)].T, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1
        )
        ax.set_title(f"training {unit} per client, by {name}")
        ax.set_xlabel(f"{len(counts)} clients, sorted by their largest {name}")
        ax.set_ylabel(name)
        if matrix.shape[1] <= 20:  # one tick per class/site; beyond, the default ticks (a label each is O(N))
            ax.set_yticks(range(matrix.shape[1]))
        fig.colorbar(image, ax=ax, label=f"share of the client's {unit}")
        sizes = matrix.sum(1)
        hist = axes[1][col]
        hist.hist(sizes, bins=min(30, max(5, len(set(sizes.tolist())))), color="C0")
        hist.set_xlabel(f"training {unit} per client")
        hist.set_ylabel("clients")
        hist.set_title(f"client sizes: median {np.median(sizes):.0f}, min {sizes.min():.0f}, max {sizes.max():.0f}")
    return fig


def plot_node_matrix(
    matrix: dict[str, dict[str, dict[str, Any]]],
    path: Path,
    metric: str = "acc",
    *,
    who: str = "node",
    title: str | None = None,
) -> None:
    """Heat map of each node's model (rows) on each node's test set (columns, plus any further ones: ``pooled``).

    Args:
        matrix: ``{holder: {test set: {metric: value}}}`` (values may be None when undefined).
        path: Output PNG.
        metric: The metric to show.
        who: What the rows and columns are (``node`` in peer-to-peer runs, ``client`` in cross-site evaluation).
        title: The figure's title (default: the metric and what is shown).

    """
    plt = pyplot()
    nodes = list(matrix)
    tests = list(dict.fromkeys(t for row in matrix.values() for t in row))
    values = np.array([[_num(matrix[h].get(t, {}).get(metric)) or np.nan for t in tests] for h in nodes], dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 * len(tests) + 2, 1.0 * len(nodes) + 1.5))
    image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis")
    for i in range(len(nodes)):
        for j in range(len(tests)):
            ax.text(j, i, f"{values[i, j]:.3f}", ha="center", va="center", color="w" if values[i, j] < 0.6 else "k")
    ax.set_xticks(range(len(tests)), tests, rotation=45 if len(tests) > 5 else 0)
    ax.set_yticks(range(len(nodes)), nodes)
    ax.set_xlabel(f"test set of {who}")
    ax.set_ylabel(f"model of {who}")
    ax.set_title(title or f"test {metric}: every {who}'s model on every {who}'s data")
    fig.colorbar(image, ax=ax)
    save_figure(fig, path)


def _num(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) else out


def save_figure(fig: Figure, path: Path, dpi: int = 110, compact: bool = False) -> None:
    """Write ``fig`` to ``path`` through a temporary file that is renamed (never a half-written PNG), and close it.

    A figure without a layout engine of its own gets the tight layout.

    Args:
        fig: The figure.
        path: Output PNG.
        dpi: Resolution.
        compact: Write the smallest faithful PNG (:func:`_compact_png`) instead of matplotlib's RGBA one; for
            figures of many images, whose pixels dominate the file.
    """
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    if compact:
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=dpi, format="png")
        tmp.write_bytes(_compact_png(buffer.getvalue()))
    else:
        fig.savefig(tmp, dpi=dpi)
    pyplot().close(fig)
    tmp.replace(path)


def _compact_png(png: bytes) -> bytes:
    """``png`` re-encoded small: 8-bit grey if every pixel is grey (lossless), else RGB without the opaque alpha.

    A colour image still over :data:`COMPACT_PNG_BYTES` gets a 256-colour palette (median cut, no dithering:
    deterministic; colour photographs lose some nuance, the figure's text and masks none that matter).
    """
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        rgb = image.convert("RGB")
    pixels = np.asarray(rgb)
    grey = bool((pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all())
    out = _png_bytes(rgb.convert("L") if grey else rgb)
    if not grey and len(out) > COMPACT_PNG_BYTES:
        out = _png_bytes(rgb.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE))
    return out


def _png_bytes(image: Any) -> bytes:
    """A PIL image as PNG bytes (zlib's default level: ``optimize`` would cost seconds on a large RGB figure)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def domain_counts(data: Any) -> dict[str, Any] | None:
    """Training samples per site/domain of each client (for ``partition.png``), when the data know them."""
    domains = {c: data.client_data(c).train_domain for c in data.client_ids}
    if any(d is None for d in domains.values()):
        return None
    size = int(max(int(d.max()) for d in domains.values() if len(d)) + 1)
    return {c: torch.bincount(d, minlength=size).numpy() for c, d in domains.items()}
