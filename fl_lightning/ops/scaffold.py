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
    """Server control update of the paper: c ← c + (|S|/N) · mean_{i∈S}(c_i⁺ − c_i) = c + Σ_{i∈S}(c_i⁺ − c_i) / N."""
    return {k: c[k] + delta_sum[k] / num_clients for k in c}


def weighted_server_control(
    c: Mapping[str, Tensor], weighted_delta_sum: Mapping[str, Tensor], weight_sum: float, participation: float
) -> dict[str, Tensor]:
    """Weighted server control update: c ← c + P · Σ_{i∈S} π_i (c_i⁺ − c_i) / Σ_{i∈S} π_i.

    With full participation (P = 1) and weights π_i that do not change between rounds, c stays the π-weighted mean
    of the clients' c_i. With π_i = p_i τ_i (aggregation weight × local steps) that mean makes the corrections cancel
    in the aggregated update: Σ_i p_i Σ_{k<τ_i} (c − c_i) = Σ_i p_i τ_i (c − c_i) = 0. With π_i = 1/N and
    P = |S|/N (uniform weights, equal steps) it is the paper's :func:`server_control`.

    Args:
        c: The server control variate.
        weighted_delta_sum: Σ_{i∈S} π_i (c_i⁺ − c_i).
        weight_sum: Σ_{i∈S} π_i (> 0).
        participation: P, the population weight of the round's participants (|S|/N with uniform weights).

    Returns:
        The new server control variate.

    """
    if weight_sum <= 0:
        raise ValueError(f"SCAFFOLD control weights must sum to > 0, got {weight_sum}")
    scale = participation / weight_sum
    return {k: c[k] + weighted_delta_sum[k] * scale for k in c}
