"""FedDyn (Acar et al., ICLR 2021): the dynamic regulariser's pure update rules.

Client i in round t minimises L_i(θ) − ⟨g_i, θ⟩ + (α/2)‖θ − θ^{t−1}‖², where g_i = ∇L_i(θ_i^{t−1}) is its
private linear term (zero before its first round). After training, g_i ← g_i − α(θ_i^t − θ^{t−1}).
The server keeps h: h ← h − (α/m) Σ_{i∈P_t} (θ_i^t − θ^{t−1}) over the m clients, and sets
θ^t = mean_{i∈P_t} θ_i^t − h/α.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


@torch.no_grad()
def add_dynamic_gradient(
    params: Sequence[Tensor], anchors: Sequence[Tensor], linear: Sequence[Tensor], alpha: float
) -> None:
    """In place: ∇ ← ∇ − g_i + α(θ − θ^{t−1}), the gradient of the two FedDyn terms added to the loss's."""
    for p, a, g in zip(params, anchors, linear, strict=True):
        if p.grad is not None:
            p.grad.add_(p - a, alpha=alpha).sub_(g)


def client_linear_update(
    linear: Mapping[str, Tensor], local: Mapping[str, Tensor], received: Mapping[str, Tensor], alpha: float
) -> dict[str, Tensor]:
    """g_i ← g_i − α(θ_i^t − θ^{t−1}) (the client's gradient at its new point, by the stationarity condition)."""
    return {k: linear[k] - alpha * (local[k] - received[k]) for k in linear}


def server_h_update(
    h: Mapping[str, Tensor], delta_sum: Mapping[str, Tensor], alpha: float, num_clients: int
) -> dict[str, Tensor]:
    """H ← h − (α/m) Σ_{i∈P_t}(θ_i^t − θ^{t−1})."""
    return {k: h[k] - alpha * delta_sum[k] / num_clients for k in h}


def server_model(averaged: Mapping[str, Tensor], h: Mapping[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """θ^t = mean of the participants' models − h/α (on the keys of h; other entries as averaged)."""
    return {**averaged, **{k: averaged[k] - h[k] / alpha for k in h}}
