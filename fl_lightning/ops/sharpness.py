"""The weight-perturbation (sharpness-aware) step of HarmoFL as pure functions on parameter lists."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

EPS = 1e-12


def global_grad_norm(grads: Sequence[Tensor]) -> Tensor:
    """‖g‖₂ over all gradients together (one norm for the whole model, not one per tensor).

    Args:
        grads: Gradient tensors (at least one).

    Returns:
        A scalar tensor in float32 or wider, on the first gradient's device.

    """
    wide = [g.float() if g.dtype in (torch.float16, torch.bfloat16) else g for g in grads]
    # torch's public total norm: one norm per tensor (fused where torch can), then the norm of those norms.
    return torch.nn.utils.get_total_norm(wide, norm_type=2.0)


def perturbation(grads: Sequence[Tensor], alpha: float, eps: float = EPS) -> list[Tensor]:
    """δ = α · g / (‖g‖₂ + eps), with the global norm of :func:`global_grad_norm`.

    Args:
        grads: Gradient tensors g.
        alpha: Perturbation radius α ≥ 0.
        eps: Guard against a zero gradient.

    Returns:
        One tensor δ_i per gradient, same shapes and dtypes.

    """
    if not grads:
        return []
    scale = alpha / (global_grad_norm(grads) + eps)
    return [g * scale.to(g.device, g.dtype) for g in grads]


@torch.no_grad()
def perturb(params: Sequence[Tensor], alpha: float, eps: float = EPS) -> list[tuple[Tensor, Tensor]]:
    """In place: w ← w + δ for every parameter with a gradient; returns what :func:`restore` needs.

    Args:
        params: Parameters; those with ``grad=None`` are left alone.
        alpha: Perturbation radius α ≥ 0.
        eps: Guard against a zero gradient.

    Returns:
        ``(parameter, copy of its unperturbed weights)`` for every perturbed parameter.

    """
    with_grad = [p for p in params if p.grad is not None]
    saved = [(p, p.detach().clone()) for p in with_grad]
    for p, delta in zip(with_grad, perturbation([p.grad for p in with_grad], alpha, eps)):
        p.add_(delta)
    return saved


@torch.no_grad()
def restore(saved: Sequence[tuple[Tensor, Tensor]]) -> None:
    """In place: copy back the weights saved by :func:`perturb` (exactly, not by subtracting δ).

    Args:
        saved: What :func:`perturb` returned.

    """
    for p, original in saved:
        p.copy_(original)
