"""FedProx's proximal gradient term."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


@torch.no_grad()
def add_proximal_gradient(params: Sequence[Tensor], anchors: Sequence[Tensor], mu: float) -> None:
    """In place: grad += μ (w − w_global), the gradient of (μ/2)‖w − w_global‖².

    Parameters without a gradient (frozen, or unused in this step) are left alone, as the
    proximal term of an untrained parameter is constant.

    Args:
        params: The client's trainable parameters.
        anchors: The global weights received at the start of the round, same order and shapes.
        mu: Proximal coefficient μ ≥ 0.

    """
    if mu == 0:
        return
    for p, a in zip(params, anchors, strict=True):
        if p.grad is not None:
            p.grad.add_(p.detach() - a, alpha=mu)
