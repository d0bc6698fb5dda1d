"""Server-side adaptive optimisers of the FedOpt family (FedAdam, FedYogi, FedAdagrad)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

ServerOptimizer = Literal["adam", "yogi", "adagrad"]


def fedopt_step(
    w: Tensor,
    delta: Tensor,
    m: Tensor,
    v: Tensor,
    kind: ServerOptimizer,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One server step on pseudo-gradient Δ = Σ p_i (w_i − w); returns (w, m, v), all new tensors.

    m ← β₁ m + (1 − β₁) Δ; v ← β₂ v + (1 − β₂) Δ² (Adam), v − (1 − β₂) Δ² sign(v − Δ²) (Yogi),
    v + Δ² (Adagrad); w ← w + η m / (√v + ε). No bias correction (Reddi et al., 2021).
    """
    m = beta1 * m + (1 - beta1) * delta
    sq = delta * delta
    if kind == "adam":
        v = beta2 * v + (1 - beta2) * sq
    elif kind == "yogi":
        v = v - (1 - beta2) * sq * torch.sign(v - sq)
    elif kind == "adagrad":
        v = v + sq
    else:
        raise ValueError(f"FedOpt optimizer must be adam, yogi or adagrad, got {kind!r}")
    return w + lr * m / (v.sqrt() + eps), m, v
