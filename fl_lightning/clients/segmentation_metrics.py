"""Segmentation metrics from a dataset-level confusion matrix, and the soft Dice loss.

Counts are accumulated over all pixels of a client's test set (not averaged per batch or per image), so
the numbers do not depend on the batch size. A class absent from both the targets and the predictions
has no defined Dice and is left out of the means (as torchmetrics' macro Jaccard index does).

This Dice equals torchmetrics' ``DiceScore(include_background=False, average="macro", aggregation_level="global")``
(``tests/clients/test_surface_metrics.py`` pins it; its default ``aggregation_level="samplewise"``, the mean of
per-image Dice, is another metric). It stays hand-written because it is read off the pixel confusion matrix the
evaluation keeps for accuracy anyway: a (C, C) integer count whose sum over clients is exactly the pooled test set's,
where ``DiceScore`` would add two metric objects (foreground, with background) whose per-image states grow with the
test set. Boundary metrics (HD95, surface Dice) are in :mod:`fl_lightning.clients.surface_metrics`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def pixel_confusion(preds: Tensor, target: Tensor, num_classes: int) -> Tensor:
    """Counts M[t, p] of pixels of true class t predicted as p, int64 (num_classes, num_classes)."""
    idx = target.reshape(-1).long() * num_classes + preds.reshape(-1).long()
    return torch.bincount(idx, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def dice_per_class(confusion: Tensor) -> Tensor:
    """Dice 2TP / (2TP + FP + FN) of every class; ``nan`` for a class absent from targets and predictions."""
    cm = confusion.double()
    tp = cm.diag()
    denom = cm.sum(0) + cm.sum(1)  # (TP + FP) + (TP + FN)
    return torch.where(denom > 0, 2 * tp / denom.clamp_min(1), torch.full_like(tp, math.nan))


def _nanmean(values: Tensor) -> float:
    values = values[~values.isnan()]
    return float(values.mean()) if values.numel() else math.nan


def segmentation_metrics(confusion: Tensor) -> dict[str, float]:
    """Foreground Dice, Dice with background, and pixel accuracy from a pixel confusion matrix.

    Args:
        confusion: (C, C) counts from :func:`pixel_confusion`, class 0 = background.

    Returns:
        ``dice``: mean Dice over the foreground classes 1 … C−1 (the headline metric);
        ``dice_with_background``: mean Dice over all C classes, background included (labelled as such
        because background Dice is high and flatters the mean); ``acc``: pixel accuracy; ``predicted_foreground``:
        the fraction of pixels predicted as any foreground class (near 1: the model paints foreground everywhere).

    """
    dice = dice_per_class(confusion)
    total = confusion.sum()
    return {
        "dice": _nanmean(dice[1:]),
        "dice_with_background": _nanmean(dice),
        "acc": float(confusion.diag().sum() / total) if total else math.nan,
        "predicted_foreground": float(confusion[:, 1:].sum() / total) if total else math.nan,
    }


def soft_dice_sums(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Per-class Σ p·g and Σ p + Σ g over the batch and all pixels (p = softmax probabilities, g = one-hot).

    Args:
        logits: (N, C, H, W) scores.
        target: (N, H, W) class indices.

    Returns:
        ``(intersection, denominator)``, float32 tensors of shape (C,); sums over batches add up.

    """
    num_classes = logits.shape[1]
    probs = logits.float().softmax(1)
    onehot = F.one_hot(target.long(), num_classes).permute(0, 3, 1, 2).to(probs.dtype)
    dims = (0, 2, 3)
    return (probs * onehot).sum(dims), probs.sum(dims) + onehot.sum(dims)


def soft_dice_from_sums(
    intersection: Tensor, denominator: Tensor, include_background: bool = False, smooth: float = 1.0
) -> Tensor:
    """1 − mean over classes of (2Σ p·g + s) / (Σ p + Σ g + s), from :func:`soft_dice_sums`."""
    dice = (2 * intersection + smooth) / (denominator + smooth)
    if not include_background and dice.numel() > 1:
        dice = dice[1:]
    return 1 - dice.mean()


def soft_dice_loss(logits: Tensor, target: Tensor, include_background: bool = False, smooth: float = 1.0) -> Tensor:
    """Soft Dice loss of a batch: sums over the batch and all pixels, then the mean over classes.

    Args:
        logits: (N, C, H, W) scores.
        target: (N, H, W) class indices.
        include_background: Average over class 0 too (default: the foreground classes only, as the metric).
        smooth: Additive smoothing s; a class absent from the batch and not predicted scores ≈ 1.

    Returns:
        A scalar loss in [0, 1].

    """
    return soft_dice_from_sums(*soft_dice_sums(logits, target), include_background=include_background, smooth=smooth)
