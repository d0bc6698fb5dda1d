"""AUROC stays in [0, 1] where torchmetrics' float32 integration overshoots (1.0000001 on a perfect split)."""

from __future__ import annotations

import torch
from torchmetrics.functional.classification import binary_auroc

from fl_lightning.clients.metrics import classification_metrics, macro_auroc


def perfectly_separated() -> tuple[torch.Tensor, torch.Tensor]:
    """363 scores, positives all above negatives, for which torchmetrics returns 1.0000001192 (found by search)."""
    g = torch.Generator().manual_seed(21)
    n = int(torch.randint(5, 400, (1,), generator=g))
    target = (torch.rand(n, generator=g) < 0.3).long()
    scores = torch.rand(n, generator=g) * 0.1 + target * 0.5
    return scores, target


def test_the_case_overshoots_in_torchmetrics() -> None:
    scores, target = perfectly_separated()
    assert binary_auroc(scores, target).item() > 1.0  # the premise: integrating the curve in float32 reports > 1


def test_macro_auroc_of_a_perfect_split_is_exactly_one() -> None:
    scores, target = perfectly_separated()
    probs = torch.stack([1 - scores, scores], dim=1)
    assert macro_auroc(probs, target) == 1.0


def test_classification_metrics_report_auroc_in_unit_range() -> None:
    scores, target = perfectly_separated()
    logits = torch.stack([torch.zeros_like(scores), scores], dim=1)
    auroc = classification_metrics(logits, target, num_classes=2)["auroc"]
    assert 0.0 <= auroc <= 1.0 and auroc == 1.0
