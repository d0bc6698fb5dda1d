"""Boundary metrics of 2-D segmentations: HD95 and surface Dice per image and class, vectorised in torch.

Both follow MONAI's definitions (``monai.metrics.compute_hausdorff_distance(..., percentile=95)`` and
``monai.metrics.compute_surface_dice``, which the tests compare against) but run on whole batches at once: MONAI
loops over every (image, class) pair in Python (about 0.3 s per metric for one client's 40 test images of 24 × 24
px with 4 foreground classes, while the whole evaluation of the embedded task's five clients takes ~0.05 s); this
takes a few milliseconds there, on the evaluation's device.

Definitions, per image and foreground class, distances in pixels (the images carry no spacing):

- The boundary of a mask is its pixels with a 4-neighbour outside the mask or the image (MONAI's edges: the mask
  XOR its binary erosion with the cross-shaped structure).
- ``d(P→T)``: for each boundary pixel of the prediction, the Euclidean distance to the nearest boundary pixel of
  the truth; ``d(T→P)`` the other way round.
- HD95 = max(95th percentile of d(P→T), 95th percentile of d(T→P)) (percentiles with linear interpolation, as
  ``torch.quantile``).
- Surface Dice (normalised surface distance) at tolerance τ = (#{d(P→T) ≤ τ} + #{d(T→P) ≤ τ}) / (|∂P| + |∂T|):
  the fraction of both boundaries within τ pixels of the other.

Empty masks: a class absent from both the prediction and the truth of an image has neither value (``nan``: left
out of every mean, as MONAI does and as Dice leaves out a class absent from both); a class present in only one
of them has surface Dice 0 (as MONAI) and HD95 equal to the image diagonal √(H² + W²) — a finite worst case,
larger than any distance between two pixels of the image (MONAI returns ``inf`` or ``nan`` there, which make
a mean infinite or undefined).

A test set's value is, per foreground class, the mean over its images where the class is defined, then the mean
over the classes with a defined value (macro over classes, like ``dice``). The per-class sums and counts add up
over test sets, so the pooled value of several clients is exactly the value over their concatenated test sets.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

HD_PERCENTILE = 95.0
# Default tolerance τ of the surface Dice, in pixels: a boundary one pixel off (the annotation's own uncertainty
# at the embedded task's 24 px) counts as correct, two pixels off does not.
SURFACE_TOLERANCE = 1.0
# The distance transform's row minimum holds at most this many floats at a time (64 MiB).
_CHUNK_ELEMENTS = 2**24


def mask_edges(masks: Tensor) -> Tensor:
    """Boundary pixels of binary masks: mask pixels with a 4-neighbour outside the mask or outside the image.

    Args:
        masks: (N, H, W) bool.

    Returns:
        (N, H, W) bool; equals MONAI's ``get_mask_edges`` (scipy's binary erosion, cross structure, border 0).

    """
    n, h, w = masks.shape
    padded = torch.zeros(n, h + 2, w + 2, dtype=torch.bool, device=masks.device)
    padded[:, 1:-1, 1:-1] = masks
    interior = (
        masks & padded[:, :-2, 1:-1] & padded[:, 2:, 1:-1] & padded[:, 1:-1, :-2] & padded[:, 1:-1, 2:]
    )  # fmt: skip
    return masks & ~interior


def column_distances_sq(sites: Tensor) -> Tensor:
    """Squared distance from every pixel to the nearest site in its column (``inf`` in a column without one).

    Args:
        sites: (N, H, W) bool.

    Returns:
        (N, H, W) float32; two running scans (the nearest site at or above, at or below), O(N · H · W).

    """
    h = sites.shape[1]
    rows = torch.arange(h, dtype=torch.float32, device=sites.device).view(1, h, 1)
    inf = torch.tensor(math.inf, device=sites.device)
    above = torch.where(sites, rows, -inf).cummax(1).values
    below = torch.where(sites, rows, inf).flip(1).cummin(1).values.flip(1)
    return torch.minimum(rows - above, below - rows).square()


def distances_at(sites: Tensor, queries: Tensor) -> tuple[Tensor, Tensor]:
    """Exact Euclidean distance from every query pixel to the nearest site of its image.

    Separable: the squared distance to the nearest site in each column (:func:`column_distances_sq`), then for a
    query at (y, x) the minimum over its row of (x − x')² + that column distance² — only at the query pixels
    (boundary pixels, a few per row), so the work is O(N · H · W + queries · min(H, W)), chunked to bound memory.
    Squared distances are integers, exact in float32 below 2²⁴ (images up to ~2900 px).

    Args:
        sites: (N, H, W) bool.
        queries: (N, H, W) bool.

    Returns:
        ``(image, distance)``: per query pixel, ordered by image (within an image in no particular order), its
        image's index (int64) and its distance in pixels (float32; ``inf`` when its image has no site).

    """
    if sites.shape[2] > sites.shape[1]:  # the minimum runs along the shorter side
        sites, queries = sites.transpose(1, 2), queries.transpose(1, 2)
    column_sq = column_distances_sq(sites)
    image, y, x = queries.nonzero(as_tuple=True)
    width = sites.shape[2]
    cols = torch.arange(width, dtype=torch.float32, device=sites.device)
    out = torch.empty(image.shape, dtype=torch.float32, device=sites.device)
    chunk = max(1, _CHUNK_ELEMENTS // width)
    for start in range(0, image.numel(), chunk):
        part = slice(start, start + chunk)
        row_sq = column_sq[image[part], y[part]]  # (k, W)
        out[part] = (row_sq + (x[part, None].float() - cols).square()).amin(1)
    return image, out.sqrt()


def grouped_quantile(group: Tensor, values: Tensor, num_groups: int, q: float) -> Tensor:
    """The ``q``-quantile of ``values`` within each group (linear interpolation, as ``torch.quantile``).

    Args:
        group: (M,) int64 group of each value, in [0, num_groups).
        values: (M,) float.
        num_groups: G.
        q: Quantile in [0, 1].

    Returns:
        (G,) float64; ``nan`` for a group without values.

    """
    order = values.argsort(stable=True)
    order = order[group[order].argsort(stable=True)]  # by group, within a group by value
    ordered = values[order].double()
    count = torch.bincount(group, minlength=num_groups)
    first = count.cumsum(0) - count
    rank = q * (count - 1).clamp_min(0).double()
    below, above = rank.floor().long(), rank.ceil().long()
    last = max(ordered.numel() - 1, 0)
    padded = ordered if ordered.numel() else torch.zeros(1, dtype=torch.float64, device=values.device)
    low, high = padded[(first + below).clamp_max(last)], padded[(first + above).clamp_max(last)]
    out = torch.lerp(low, high, rank - below)
    return torch.where(count > 0, out, torch.full_like(out, math.nan))


def surface_metrics_per_image(
    preds: Tensor,
    target: Tensor,
    num_classes: int,
    tolerance: float = SURFACE_TOLERANCE,
    percentile: float = HD_PERCENTILE,
) -> tuple[Tensor, Tensor]:
    """HD95 and surface Dice of every image and foreground class (definitions and empty cases: the module's doc).

    Args:
        preds: (B, H, W) predicted class indices.
        target: (B, H, W) true class indices, 0 = background.
        num_classes: Classes including background.
        tolerance: τ of the surface Dice, in pixels.
        percentile: The Hausdorff distance's percentile (95: HD95; 100: the Hausdorff distance).

    Returns:
        ``(hd, surface_dice)``, float64 (B, num_classes − 1) (column j: class j + 1); ``nan`` where the class is in
        neither the prediction nor the truth of the image.

    """
    b, h, w = target.shape
    classes = torch.arange(1, num_classes, device=target.device).view(1, -1, 1, 1)
    pred_edges = mask_edges((preds.unsqueeze(1) == classes).flatten(0, 1))  # (B · (C − 1), H, W)
    true_edges = mask_edges((target.unsqueeze(1) == classes).flatten(0, 1))
    pairs = pred_edges.shape[0]
    n_pred, n_true = pred_edges.flatten(1).sum(1), true_edges.flatten(1).sum(1)
    image_p, to_true = distances_at(true_edges, pred_edges)  # d(P→T), per boundary pixel of a prediction
    image_t, to_pred = distances_at(pred_edges, true_edges)  # d(T→P)
    q = percentile / 100
    hd = torch.maximum(
        grouped_quantile(image_p, to_true, pairs, q), grouped_quantile(image_t, to_pred, pairs, q)
    )  # fmt: skip
    within = torch.bincount(image_p, weights=(to_true <= tolerance).double(), minlength=pairs) + torch.bincount(
        image_t, weights=(to_pred <= tolerance).double(), minlength=pairs
    )
    one_only = (n_pred > 0) ^ (n_true > 0)
    hd = torch.where(one_only, torch.full_like(hd, math.hypot(h, w)), hd)  # nan already where both are empty
    surface_dice = within / (n_pred + n_true).double()  # 0 where one is empty, 0/0 = nan where both are
    return hd.view(b, -1), surface_dice.view(b, -1)


def surface_sums(hd: Tensor, surface_dice: Tensor) -> dict[str, Tensor]:
    """Per-class sums over images of HD95 and surface Dice and the number of images where they are defined.

    Args:
        hd: (B, C − 1) from :func:`surface_metrics_per_image`.
        surface_dice: (B, C − 1), ``nan`` exactly where ``hd`` is.

    Returns:
        ``hd95_sum``, ``surface_dice_sum`` (float64) and ``surface_images`` (int64), each (C − 1,); additive over
        batches and test sets.

    """
    return {
        "hd95_sum": hd.nansum(0),
        "surface_dice_sum": surface_dice.nansum(0),
        "surface_images": (~hd.isnan()).sum(0),
    }


def surface_metrics_from_sums(hd95_sum: Tensor, surface_dice_sum: Tensor, surface_images: Tensor) -> dict[str, float]:
    """``hd95`` and ``surface_dice``: per class the mean over the images where defined, then the mean over classes.

    Args:
        hd95_sum: (C − 1,) sums of :func:`surface_sums` (of one test set or several added up).
        surface_dice_sum: (C − 1,) sums.
        surface_images: (C − 1,) counts.

    Returns:
        Both metrics; ``nan`` when no class is defined on any image (no foreground predicted or present).

    """
    defined = surface_images > 0
    if not defined.any():
        return {"hd95": math.nan, "surface_dice": math.nan}
    count = surface_images[defined].double()
    return {
        "hd95": float((hd95_sum[defined].double() / count).mean()),
        "surface_dice": float((surface_dice_sum[defined].double() / count).mean()),
    }
