"""SCAFFOLD (option II) control variates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


@torch.no_grad()
def correct_gradients(params: Sequence[Tensor], corrections: Sequence[Tensor]) -> None:
    """In place: g ← g + (c − c_i) for every parameter with a gradient."""
    for p, corr in zip(params, corrections, strict=True):
        if p.grad is not None:
            p.grad.add_(corr)


def client_control(
    c_i: Mapping[str, Tensor],
    c: Mapping[str, Tensor],
    w_global: Mapping[str, Tensor],
    w_local: Mapping[str, Tensor],
    steps: int,
    lr: float,
) -> dict[str, Tensor]:
    """c_i⁺ = c_i − c + (w − w_i) / (τ_i η)."""
    if steps <= 0 or lr <= 0:
        raise ValueError(f"SCAFFOLD needs positive steps and learning rate, got steps={steps}, lr={lr}")
    return {k: c_i[k] - c[k] + (w_global[k] - w_local[k]) / (steps * lr) for k in c}


def server_control(c: Mapping[str, Tensor], delta_sum: Mapping[str, Tensor], num_clients: int) -> dict[str, Tensor]:
    """Server control update: c ← c + (|S|/N) · mean_{i∈S}(c_i⁺ − c_i) = c + Σ_{i∈S}(c_i⁺ − c_i) / N."""
    return {k: c[k] + delta_sum[k] / num_clients for k in c}
