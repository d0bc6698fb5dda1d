"""APFL's mixture of a personal and a global model, and the gradient step of its mixing weight α."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fl_lightning.ops.state import StateDict


@torch.no_grad()
def mix(personal: Tensor, global_: Tensor, alpha: float) -> Tensor:
    """α v + (1 − α) w for a floating tensor; a non-floating one (a counter) is the personal model's."""
    if not personal.is_floating_point():
        return personal.clone()
    return torch.lerp(global_.to(personal), personal, alpha)


def mix_state(personal: StateDict, global_: StateDict, alpha: float, mixed: set[str]) -> StateDict:
    """The personalised model v̄ = α v + (1 − α) w over the keys in ``mixed`` (the trainable parameters).

    Every other entry (norm layers' running statistics, counters) is the personal model's: it is not a parameter of
    the mixture and the personal model's forward passes keep it.
    """
    return {k: mix(v, global_[k], alpha) if k in mixed else v.clone() for k, v in personal.items()}


@torch.no_grad()
def alpha_step(
    alpha: float, personal: Sequence[Tensor], global_: Sequence[Tensor], grads: Sequence[Tensor | None], lr: float
) -> float:
    """One projected gradient step of the mixing weight: clip(α − η_α ⟨v − w, ∇F(v̄)⟩, 0, 1).

    ∂F(α v + (1 − α) w)/∂α = Σ ⟨v − w, ∇F(v̄)⟩ over the parameters (the chain rule through the mixture); a
    parameter without a gradient contributes nothing.

    Args:
        alpha: α ∈ [0, 1] before the step.
        personal: The personal parameters v.
        global_: The global parameters w, same order and shapes.
        grads: ∇F at the mixture v̄, per parameter (None where there is none).
        lr: η_α ≥ 0.

    Returns:
        The new α, in [0, 1].
    """
    total = torch.zeros((), dtype=torch.float64)
    for v, w, g in zip(personal, global_, grads, strict=True):
        if g is not None:
            total += torch.sum((v - w).double() * g.double()).cpu()
    return float(min(max(alpha - lr * float(total), 0.0), 1.0))
