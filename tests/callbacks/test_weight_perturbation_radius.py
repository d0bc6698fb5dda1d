"""The shipped HarmoFL radius suits its model (issue 15, degenerate training).

With the paper's α = 0.05 the perturbed loss on the digits CNN was 1.65× the loss at w at initialisation:
the perturbed gradient then optimises a different objective, which held the logits small, and the binary
15 %/85 % task ended at the majority class (balanced accuracy 0.50; experiments/degenerate.py). The step itself
is exact (α = 0 is the plain step; tests/callbacks/test_weight_perturbation.py); the radius was the cause.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from datamodules import DigitsFederated
from fl_lightning.clients import ClassificationClient
from fl_lightning.ops.sharpness import perturb, restore

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def shipped_alpha() -> float:
    cfg = yaml.safe_load((CONFIGS / "harmofl_digits.yaml").read_text())
    (wp,) = [cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("WeightPerturbation")]
    return float(wp["init_args"]["alpha"])


def perturbed_loss_ratio(alpha: float) -> float:
    """Mean over the 5 sites' first batches of L(w + δ) / L(w) at initialisation (the config's model and data)."""
    base = yaml.safe_load((CONFIGS / "fedavg_digits.yaml").read_text())
    model_args = {k: v for k, v in base["model"]["init_args"].items()}
    data = DigitsFederated(binary_positive=8, positive_fraction=0.15, seed=0)
    torch.manual_seed(0)
    module = ClassificationClient(num_classes=2, in_channels=1, image_size=data.image_size, **model_args).train()
    params = [p for p in module.parameters() if p.requires_grad]
    ratios = []
    for cid in data.client_ids:
        x, y = next(iter(data.client_train_loader(cid)))
        module.zero_grad()
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        with torch.no_grad():
            saved = perturb(params, alpha)
            ratios.append(float(F.cross_entropy(module(x), y) / loss))
            restore(saved)
    return sum(ratios) / len(ratios)


def test_the_shipped_radius_keeps_the_perturbed_loss_near_the_loss():
    assert perturbed_loss_ratio(shipped_alpha()) < 1.3


def test_the_papers_radius_does_not_on_this_model():
    # the measurement the default is chosen from: 0.05 moves the loss by far more than the bound above
    assert perturbed_loss_ratio(0.05) > 1.4
