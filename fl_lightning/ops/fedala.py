"""FedALA's adaptive local aggregation: element-wise weights that mix a client's old model with the received one.

For the aggregated layers (the top ones), the client starts its round from θ̂ = θ + (Θ − θ) ⊙ W, where θ is its own
model of its last fit, Θ the received global model and W ∈ [0, 1] (element-wise, one per parameter entry) is learned
on the client's data: W ← clip(W − η ∂L(θ̂)/∂W, 0, 1), with ∂L/∂W = ∇_θ̂ L ⊙ (Θ − θ) by the chain rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


@torch.no_grad()
def ala_mix(local: Sequence[Tensor], global_: Sequence[Tensor], weights: Sequence[Tensor]) -> list[Tensor]:
    """θ̂ = θ + (Θ − θ) ⊙ W per tensor; W = 1 gives Θ and W = 0 gives θ exactly.

    ``torch.lerp`` is exact at its ends, where the written-out sum would round.
    """
    return [torch.lerp(theta, big, w) for theta, big, w in zip(local, global_, weights, strict=True)]


@torch.no_grad()
def ala_weight_step(
    weights: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    local: Sequence[Tensor],
    global_: Sequence[Tensor],
    eta: float,
) -> list[Tensor]:
    """One projected gradient step of the aggregation weights: clip(W − η ∇_θ̂L ⊙ (Θ − θ), 0, 1).

    Args:
        weights: W per aggregated tensor, in [0, 1].
        grads: ∇L at θ̂ per tensor (None: the tensor took no part in the loss, its W is kept).
        local: The client's own θ, same order and shapes.
        global_: The received Θ.
        eta: η ≥ 0, the weights' step size (FedALA's 1.0).

    Returns:
        The new weights (new tensors; the inputs are unchanged).
    """
    out = []
    for w, g, theta, big in zip(weights, grads, local, global_, strict=True):
        out.append(w.clone() if g is None else torch.clamp(w - eta * g * (big - theta), 0.0, 1.0))
    return out


def converged(losses: Sequence[float], window: int, threshold: float) -> bool:
    """FedALA's stopping rule for the first adaptation: more than ``window`` pass losses, the last ``window`` low.

    Low: their (population) standard deviation is below ``threshold``.
    """
    if len(losses) <= window:
        return False
    last = losses[-window:]
    mean = sum(last) / window
    return math.sqrt(sum((x - mean) ** 2 for x in last) / window) < threshold
