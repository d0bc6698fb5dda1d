"""Classification metrics over the classes that actually occur.

Client test sets under label skew miss classes; averaging a recall of 0/0 over them (as a fixed
``num_classes`` macro average would) misreports them, so these follow scikit-learn's convention.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics.functional.classification import binary_auroc


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


def macro_auroc(probs: Tensor, target: Tensor) -> float:
    """One-vs-rest AUROC averaged over the classes that have both positives and negatives in ``target``.

    ``nan`` when no class qualifies (e.g. a test set of a single class), since AUROC is then undefined.
    Each class's AUROC is clipped to [0, 1]: torchmetrics integrates the ROC curve in float32, and a perfect
    separation can come out as 1.0000001, which is no AUROC and reads as a bug in a results table.
    """
    scores = [
        min(max(binary_auroc(probs[:, c], (target == c).long()).item(), 0.0), 1.0)
        for c in range(probs.shape[1])
        if 0 < int((target == c).sum()) < len(target)
    ]
    return sum(scores) / len(scores) if scores else math.nan


def classification_metrics(logits: Tensor, target: Tensor, num_classes: int) -> dict[str, float]:
    """Loss, accuracy, balanced accuracy, macro-F1, macro AUROC and the number of distinct predicted classes.

    ``predicted_classes`` makes a collapsed model visible (1 = the same class for every image; see
    :mod:`fl_lightning.collapse`): its accuracy alone looks fine on an imbalanced test set.
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
