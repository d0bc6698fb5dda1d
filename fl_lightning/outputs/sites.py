"""``sites.png``: a few training images per client, so a reader sees the sites' styles and masks at a glance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from datamodules.base import FederatedDataModule
from fl_lightning.outputs.plots import pyplot, save_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# At most this many clients (one row each): a row per client of 1,000 would be unreadable.
MAX_SITE_ROWS = 12
# Example training images per client.
SITE_EXAMPLES = 6
# Opacity of a segmentation mask's colours over its image: enough to tell the classes apart, little enough to
# still see the site's intensities (contrast, inversion, noise) underneath.
MASK_ALPHA = 0.45


def site_examples(
    data: FederatedDataModule, per_client: int = SITE_EXAMPLES, max_clients: int = MAX_SITE_ROWS
) -> dict[str, SiteExamples]:
    """Example training images of the first ``max_clients`` clients, for ``sites.png``.

    Each client shows ``per_client`` images evenly spaced over its training set: deterministic, and spread over
    the set's order (which follows the pooled data's, so the first images alone would often share a class). The
    row names the client's site style when it has one; captions hold a classification image's class and, for a
    client whose images come from several styles or domains, the image's.

    Args:
        data: The run's datamodule.
        per_client: Images per client.
        max_clients: Clients shown (the first ones, in client order).

    Returns:
        ``{client: examples}`` in client order.
    """
    out: dict[str, SiteExamples] = {}
    names = data.label_names()
    for cid in data.client_ids[:max_clients]:
        split = data.client_data(cid)
        pick = evenly_spaced(len(split.train_y), per_client)
        labels = split.train_y[pick].numpy()
        masks = labels if labels.ndim > 1 else None  # segmentation: one class per pixel
        name, notes = _describe_kinds(data.image_sources(cid), pick)
        captions = _captions(labels if masks is None else None, notes, names)
        out[cid] = SiteExamples(split.train_x[pick].numpy(), masks, captions, name, len(split.train_y))
    return out


def evenly_spaced(n: int, k: int) -> np.ndarray:
    """``min(n, k)`` distinct indices in ``range(n)``, evenly spaced from the first to the last."""
    return np.unique(np.linspace(0, n - 1, num=min(n, k)).round().astype(np.int64))


def _describe_kinds(kinds: tuple[list[str], str] | None, pick: np.ndarray) -> tuple[str | None, list[str] | None]:
    """The row's name (the one style, or how many) and, for a client of several, each shown image's."""
    if kinds is None:
        return None, None
    names, what = kinds
    distinct = set(names)
    if len(distinct) == 1:
        return names[0], None
    return f"{len(distinct)} {what}", [names[i] for i in pick.tolist()]


def _captions(labels: np.ndarray | None, notes: list[str] | None, names: list[str] | None) -> list[str] | None:
    """One caption per image: its class (classification) over its note (style or domain), or None if neither."""

    def name(y: int) -> str:
        return names[y] if names is not None and y < len(names) else str(y)

    parts = [[name(int(y))] for y in labels] if labels is not None else None
    if notes is not None:
        parts = [[*p, n] for p, n in zip(parts, notes)] if parts is not None else [[n] for n in notes]
    return None if parts is None else ["\n".join(p) for p in parts]  # a line each: style names are long


@dataclass(frozen=True)
class SiteExamples:
    """A few training images of one client, for :func:`plot_sites`.

    Attributes:
        images: float (k, C, H, W) with C 1 or 3 (other channel counts are shown as their mean), or (k, H, W).
        masks: Segmentation masks, int (k, H, W) of class ids (0 = background), or None for classification.
        captions: One short text per image (its label, its site style or domain), or None.
        name: What the row title adds after the client id (its site style), or None.
        num_train: The client's number of training images, for the title, or None.

    """

    images: np.ndarray
    masks: np.ndarray | None = None
    captions: Sequence[str] | None = None
    name: str | None = None
    num_train: int | None = None


def plot_sites(
    examples: Mapping[str, SiteExamples],
    path: Path,
    total_clients: int | None = None,
    class_names: Sequence[str] | None = None,
    dpi: int = 100,
) -> None:
    """One row of example training images per client (at most :data:`MAX_SITE_ROWS`), masks overlaid.

    Shows what each site's data look like: its imaging style (contrast, inversion, blur, noise, tint) and, for
    segmentation, where its mask classes are (a semi-transparent colour per class; background left clear).

    Args:
        examples: ``{client: its examples}``, in the order of the rows, every image of one shape (H, W); only the
            first :data:`MAX_SITE_ROWS` are drawn.
        path: Output PNG.
        total_clients: How many clients the run has (the title says how many of them are shown); defaults to
            ``len(examples)``.
        class_names: Names of the mask classes for the legend (index = class id), or None for "class <id>".
        dpi: Resolution of the PNG.

    Raises:
        ValueError: If ``examples`` is empty.

    """
    save_figure(sites_figure(examples, total_clients, class_names), path, dpi=dpi, compact=True)


def sites_figure(
    examples: Mapping[str, SiteExamples],
    total_clients: int | None = None,
    class_names: Sequence[str] | None = None,
) -> Figure:
    """The figure of :func:`plot_sites`: one axes per client, holding one montage image of its examples."""
    if not examples:
        raise ValueError("plot_sites needs the examples of at least one client")
    shown = list(examples.items())[:MAX_SITE_ROWS]
    total = max(total_clients or len(examples), len(examples))
    fixed = all(_in_unit_range(ex.images) for _, ex in shown)
    height, width = _grey_or_rgb(shown[0][1].images).shape[1:3]
    columns = max(len(ex.images) for _, ex in shown)
    gap = max(1, width // 8)
    plt = pyplot()
    cell = 1.05  # inches per example image: a 16-pixel digit at about 7 screen pixels per pixel
    lines = max((str(c).count("\n") + 1 for _, ex in shown for c in ex.captions or ()), default=0)
    row = cell * height / width + 0.35 + 0.14 * lines  # the image, its title and its captions' lines
    fig, axes = plt.subplots(
        len(shown),
        1,
        figsize=(max(5.5, columns * cell * (1 + gap / width) + 0.4), len(shown) * row + 0.9),
        squeeze=False,
        layout="constrained",
    )
    classes: set[int] = set()
    for ax, (cid, ex) in zip(axes[:, 0], shown):
        montage, centres = _montage(_display(ex, fixed), gap, columns)
        ax.imshow(montage, interpolation="nearest", vmin=0.0, vmax=1.0)
        _frame(ax, len(ex.images), height, width, gap)
        title = cid if ex.name is None else f"{cid} · {ex.name}"
        if ex.num_train is not None:
            title += f"   ({ex.num_train} training images)"
        ax.set_title(title, loc="left", fontsize=10, fontweight="bold")
        ax.set_yticks([])
        captions = list(ex.captions or [""] * len(ex.images))
        ax.set_xticks(centres[: len(ex.images)], captions, fontsize=8 if lines <= 1 else 7, linespacing=1.1)
        ax.tick_params(axis="x", length=0, pad=2)
        for side in ax.spines.values():
            side.set_visible(False)
        if ex.masks is not None:
            classes.update(int(c) for c in np.unique(ex.masks) if c > 0)
    fig.suptitle(_sites_title(len(shown), total, columns, fixed, masks=bool(classes)), fontsize=11)
    if classes:
        handles = _class_patches(sorted(classes), class_names)
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(classes), 6), fontsize=9)
    return fig


def _sites_title(shown: int, total: int, columns: int, fixed: bool, masks: bool) -> str:
    """``sites.png``'s title: which clients and images are shown, and how intensities map to grey levels."""
    clients = f"{shown} clients" if shown == total else f"the first {shown} of {total} clients"
    scale = "intensities as stored (0 black, 1 white)" if fixed else "intensities min-max scaled per client"
    overlay = "; masks overlaid, background clear" if masks else ""
    return f"training images of {clients}, up to {columns} each, evenly spaced over the client's set\n{scale}{overlay}"


def _in_unit_range(images: np.ndarray) -> bool:
    """Whether every pixel lies in [0, 1] (the datamodules' range; then no rescaling is needed)."""
    values = np.asarray(images, dtype=float)
    return bool(values.size == 0 or (np.nanmin(values) >= 0.0 and np.nanmax(values) <= 1.0))


def _grey_or_rgb(images: np.ndarray) -> np.ndarray:
    """``images`` as float (k, H, W, 3): one channel repeated as grey, three as RGB, any other count as its mean."""
    x = np.asarray(images, dtype=float)
    if x.ndim == 3:
        x = x[:, None]
    if x.shape[1] != 3:
        x = x.mean(1, keepdims=True).repeat(3, axis=1)
    return np.nan_to_num(x.transpose(0, 2, 3, 1))


def _display(ex: SiteExamples, fixed: bool) -> np.ndarray:
    """A client's examples as RGB in [0, 1], its masks blended in.

    Images already in [0, 1] are shown as stored, the same scale for every client: a site's low contrast, dark
    gamma or over-exposure is what the figure is for, and a min-max stretch would undo it. Otherwise (normalised
    data) the client's images are min-max scaled together, per client and not per image, so the differences
    between its images survive.
    """
    rgb = _grey_or_rgb(ex.images)
    if not fixed:
        low, high = float(rgb.min()), float(rgb.max())
        rgb = (rgb - low) / (high - low) if high > low else np.zeros_like(rgb)
    if ex.masks is not None:
        rgb = _overlay(rgb, np.asarray(ex.masks))
    return rgb


def _overlay(rgb: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """``rgb`` with each foreground pixel (class > 0) blended with its class's colour; background unchanged."""
    colours = np.asarray([_class_colour(c) for c in range(int(masks.max(initial=0)) + 1)])
    blended = (1 - MASK_ALPHA) * rgb + MASK_ALPHA * colours[masks]
    return np.where((masks > 0)[..., None], blended, rgb)


def _class_colour(c: int) -> tuple[float, float, float]:
    """The colour of mask class ``c`` >= 1 (tab10, then tab20 beyond ten classes; 0 is never coloured)."""
    plt = pyplot()
    cmap = plt.get_cmap("tab10") if c <= 10 else plt.get_cmap("tab20")
    return tuple(cmap((c - 1) % cmap.N)[:3])


def _class_patches(classes: list[int], names: Sequence[str] | None) -> list[Any]:
    """Legend handles: one colour patch per mask class, labelled with its name where known."""
    from matplotlib.patches import Patch

    def label(c: int) -> str:
        return str(names[c]) if names is not None and c < len(names) else f"class {c}"

    return [Patch(color=_class_colour(c), alpha=MASK_ALPHA + 0.2, label=label(c)) for c in classes]


def _frame(ax: Axes, count: int, height: int, width: int, gap: int) -> None:
    """A thin grey outline around each of the first ``count`` montage slots.

    Without it a light (inverted) image would run into the white gaps between the slots.
    """
    from matplotlib.patches import Rectangle

    for i in range(count):
        left = i * (width + gap) - 0.5
        ax.add_patch(Rectangle((left, -0.5), width, height, fill=False, edgecolor="0.55", lw=0.6))


def _montage(rgb: np.ndarray, gap: int, columns: int) -> tuple[np.ndarray, list[float]]:
    """The images side by side on white, ``gap`` pixels apart, padded to ``columns``; and each slot's centre."""
    k, h, w, _ = rgb.shape
    out = np.ones((h, columns * (w + gap) - gap, 3))
    for i in range(k):
        out[:, i * (w + gap) : i * (w + gap) + w] = rgb[i]
    return out, [i * (w + gap) + (w - 1) / 2 for i in range(columns)]
