"""Server-side linking of per-class mixture responsibilities into one sample clustering."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def affinity(responsibilities: Sequence[Tensor], present: Sequence[Tensor]) -> Tensor:
    """S_ab = mean over classes present in both a and b of ⟨γ_a^c, γ_b^c⟩ (0 if they share no class).

    Args:
        responsibilities: Per class c, an (N, K) matrix of γ^c (rows of samples without class c are ignored).
        present: Per class c, an (N,) boolean vector: does sample a contain class c.

    Returns:
        The (N, N) affinity matrix.
    """
    n = len(present[0])
    num = torch.zeros(n, n, dtype=torch.float64)
    den = torch.zeros(n, n, dtype=torch.float64)
    for gamma, mask in zip(responsibilities, present, strict=True):
        g = gamma.double() * mask.double().unsqueeze(1)
        num += g @ g.T
        m = mask.double()
        den += torch.outer(m, m)
    return torch.where(den > 0, num / den.clamp_min(1), torch.zeros_like(num))


def spectral_partition(similarity: Tensor, n_clusters: int, seed: int) -> np.ndarray:
    """Cluster ids (0..n_clusters-1) of every sample by spectral clustering of a precomputed affinity."""
    from sklearn.cluster import SpectralClustering  # scikit-learn only when clustering runs

    model = SpectralClustering(n_clusters=n_clusters, affinity="precomputed", random_state=seed, assign_labels="kmeans")
    return model.fit_predict(similarity.numpy())
