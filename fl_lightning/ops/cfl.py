"""Clustered FL (Sattler, Müller, Samek, 2020): when to split a cluster, and how."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def split_criterion(updates: Tensor, weights: Tensor, eps1: float, eps2: float) -> bool:
    """Whether to split: the cluster is near a stationary point yet some client is far from its own.

    Near a stationary point of the joint objective: ‖Σ p_i Δ_i‖ < ε₁; a client still far from one of
    its own: max ‖Δ_i‖ > ε₂.

    Args:
        updates: (m, P) client updates Δ_i = w_i − w.
        weights: (m,) aggregation weights p_i (summing to one).
        eps1: Threshold on the norm of the mean update.
        eps2: Threshold on the largest client update norm.
    """
    mean_norm = (weights.to(updates.dtype).unsqueeze(1) * updates).sum(0).norm()
    return bool(mean_norm < eps1) and bool(updates.norm(dim=1).max() > eps2)


def cosine_similarities(updates: Tensor) -> Tensor:
    """(m, m) cosine similarities between client updates."""
    unit = updates / updates.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return unit @ unit.T


def bipartition(updates: Tensor, identical_tol: float = 1e-6) -> list[list[int]] | None:
    """Two groups of clients by complete-linkage clustering of their updates' cosine similarities.

    Returns None when all updates point the same way (identical clients are never split) or there
    are fewer than two clients.
    """
    if len(updates) < 2:
        return None
    sim = cosine_similarities(updates.double())
    if bool((sim > 1 - identical_tol).all()):
        return None
    from sklearn.cluster import AgglomerativeClustering  # scikit-learn only when a split is tested

    labels = AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="complete").fit_predict(
        (1 - sim).clamp_min(0).numpy()
    )
    return [np.flatnonzero(labels == k).tolist() for k in (0, 1)]


def flatten(state: dict[str, Tensor], keys: list[str]) -> Tensor:
    """The listed tensors of a state dict as one float64 vector."""
    return torch.cat([state[k].detach().double().flatten() for k in keys])
