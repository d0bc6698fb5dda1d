"""Classification metrics over the classes that actually occur.

Client test sets under label skew miss classes; averaging a recall of 0/0 over them (as a fixed
``num_classes`` macro average would) misreports them, so these follow scikit-learn's convention.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def confusion_matrix(preds: Tensor, target: Tensor, num_classes: int) -> Tensor:
    """Counts M[t, p] of samples with true class t predicted as p."""
    idx = target.long() * num_classes + preds.long()
    return torch.bincount(idx, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def balanced_accuracy(preds: Tensor, target: Tensor, num_classes: int) -> float:
    """Mean recall over the classes present in ``target`` (scikit-learn's ``balanced_accuracy_score``)."""
    cm = confusion_matrix(preds, target, num_classes).double()
    support = cm.sum(1)
    present = support > 0
    return (cm.diag()[present] / support[present]).mean().item()


def macro_f1(preds: Tensor, target: Tensor, num_classes: int) -> float:
    """Mean F1 over the classes present in ``target`` or ``preds`` (scikit-learn's ``f1_score(average="macro")``)."""
    cm = confusion_matrix(preds, target, num_classes).double()
    tp = cm.diag()
    support, predicted = cm.sum(1), cm.sum(0)
    present = (support + predicted) > 0
    f1 = torch.where(support + predicted > 0, 2 * tp / (support + predicted).clamp_min(1), torch.zeros_like(tp))
    return f1[present].mean().item()


def average_ranks(scores: Tensor) -> Tensor:
    """1-based ranks of each column's values, ties given the mean of their ranks (``scipy.stats.rankdata``)."""
    n = scores.shape[0]
    ordered, order = scores.sort(0)
    position = torch.arange(n, device=scores.device).unsqueeze(1).expand_as(ordered)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]  # a tie group starts here
    last = torch.ones_like(first)
    last[:-1] = first[1:]  # ... ends here
    start = torch.where(first, position, 0).cummax(0).values
    end = torch.where(last, position, n - 1).flip(0).cummin(0).values.flip(0)
    return torch.empty_like(scores, dtype=torch.float64).scatter_(0, order, (start + end).double() / 2 + 1)


def macro_auroc(probs: Tensor, target: Tensor) -> float:
    """One-vs-rest AUROC averaged over the classes that have both positives and negatives in ``target``.

    ``nan`` when no class qualifies (e.g. a test set of a single class), since AUROC is then undefined.
    Every class at once, from ranks: AUROC = (R⁺ − n⁺(n⁺ + 1)/2) / (n⁺ n⁻), the Mann–Whitney U statistic with
    R⁺ the sum of the positives' ranks (ties averaged), in float64 — scikit-learn's ``roc_auc_score`` up to
    rounding, and within [0, 1] by construction.
    """
    positive = target.view(-1, 1) == torch.arange(probs.shape[1], device=target.device)
    n_pos = positive.sum(0).double()
    n_neg = probs.shape[0] - n_pos
    valid = (n_pos > 0) & (n_neg > 0)
    if not bool(valid.any()):
        return math.nan
    rank_sum = (average_ranks(probs.double()) * positive).sum(0)
    auroc = (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg).clamp_min(1)
    return auroc[valid].mean().item()


def classification_metrics(logits: Tensor, target: Tensor, num_classes: int) -> dict[str, float]:
    """Loss, accuracy, balanced accuracy, macro-F1, macro AUROC and the number of distinct predicted classes.

    ``predicted_classes`` makes a collapsed model visible (1 = the same class for every image; see
    :mod:`fl_lightning.outputs.collapse`): its accuracy alone looks fine on an imbalanced test set.
    """
    preds = logits.argmax(1)
    return {
        "loss": torch.nn.functional.cross_entropy(logits, target).item(),
        "acc": (preds == target).double().mean().item(),
        "balanced_acc": balanced_accuracy(preds, target, num_classes),
        "macro_f1": macro_f1(preds, target, num_classes),
        "auroc": macro_auroc(logits.softmax(1), target),
        "predicted_classes": float(preds.unique().numel()),
    }
