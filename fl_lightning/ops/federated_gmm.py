"""Federated diagonal Gaussian mixtures: clients compute sufficient statistics, the server does the M-step.

No data point leaves a client: a client sends only Σγ, Σγx and Σγx² per component (and, for the
k-means initialisation, per-centroid counts and sums).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DiagonalGMM:
    """Mixture parameters: weights (K,), means (K, D), variances (K, D)."""

    weights: Tensor
    means: Tensor
    variances: Tensor


def log_responsibilities(x: Tensor, gmm: DiagonalGMM) -> tuple[Tensor, Tensor]:
    """The log-responsibilities log γ (N, K) and per-sample log-likelihoods (N,) of ``x`` (N, D)."""
    var = gmm.variances
    d = x.shape[1]
    log_det = var.log().sum(1)  # (K,)
    diff2 = ((x.unsqueeze(1) - gmm.means.unsqueeze(0)) ** 2 / var.unsqueeze(0)).sum(2)  # (N, K)
    log_prob = -0.5 * (d * math.log(2 * math.pi) + log_det.unsqueeze(0) + diff2) + gmm.weights.log().unsqueeze(0)
    log_norm = torch.logsumexp(log_prob, dim=1)
    return log_prob - log_norm.unsqueeze(1), log_norm


def client_statistics(x: Tensor, gmm: DiagonalGMM) -> dict[str, Tensor]:
    """What one client sends after its E-step: Σγ (K,), Σγx (K, D), Σγx² (K, D), Σ log-likelihood, n."""
    log_resp, log_norm = log_responsibilities(x, gmm)
    resp = log_resp.exp()
    return {
        "n_k": resp.sum(0),
        "s1": resp.T @ x,
        "s2": resp.T @ (x * x),
        "log_likelihood": log_norm.sum(),
        "n": torch.tensor(float(len(x)), dtype=x.dtype),
    }


def server_m_step(stats: Sequence[dict[str, Tensor]], reg_covar: float = 1e-6) -> DiagonalGMM:
    """The M-step from summed client statistics (scikit-learn's diagonal formulas)."""
    n_k = sum(s["n_k"] for s in stats) + 10 * torch.finfo(stats[0]["n_k"].dtype).eps
    s1, s2 = sum(s["s1"] for s in stats), sum(s["s2"] for s in stats)
    n = sum(s["n"] for s in stats)
    means = s1 / n_k.unsqueeze(1)
    variances = s2 / n_k.unsqueeze(1) - means**2 + reg_covar
    return DiagonalGMM(weights=n_k / n, means=means, variances=variances.clamp_min(reg_covar))


def federated_em(
    client_data: Sequence[Tensor], init: DiagonalGMM, max_iter: int = 100, tol: float = 1e-3, reg_covar: float = 1e-6
) -> tuple[DiagonalGMM, int]:
    """EM over clients until the mean log-likelihood improves by less than ``tol`` (scikit-learn's rule).

    Returns:
        The fitted mixture and the number of iterations run.
    """
    gmm, previous = init, -math.inf
    for it in range(1, max_iter + 1):
        stats = [client_statistics(x, gmm) for x in client_data]  # on each client
        mean_ll = float(sum(s["log_likelihood"] for s in stats) / sum(s["n"] for s in stats))
        gmm = server_m_step(stats, reg_covar)  # on the server
        if abs(mean_ll - previous) < tol:
            return gmm, it
        previous = mean_ll
    return gmm, max_iter


def federated_kmeans_init(
    client_data: Sequence[Tensor], k: int, seed: int, iters: int = 10, reg_covar: float = 1e-6
) -> DiagonalGMM:
    """Initial mixture by federated k-means.

    The server seeds k centroids from the global mean and standard deviation (themselves from
    client sums), then runs Lloyd iterations on per-centroid counts and sums sent by the clients;
    the resulting hard assignments give the initial weights, means and variances.
    """
    n = sum(len(x) for x in client_data)
    total = sum(x.sum(0) for x in client_data)
    total_sq = sum((x * x).sum(0) for x in client_data)
    mean = total / n
    std = (total_sq / n - mean**2).clamp_min(0).sqrt()
    g = torch.Generator().manual_seed(seed)
    centroids = mean + std * torch.randn(k, len(mean), generator=g, dtype=mean.dtype)
    for _ in range(iters):
        counts, sums = torch.zeros(k, dtype=mean.dtype), torch.zeros_like(centroids)
        for x in client_data:  # client side: assign to nearest centroid, send counts and sums
            hard = torch.cdist(x, centroids).argmin(1)
            counts += torch.bincount(hard, minlength=k).to(mean.dtype)
            sums += torch.zeros_like(centroids).index_add_(0, hard, x)
        nonempty = counts > 0
        centroids[nonempty] = sums[nonempty] / counts[nonempty].unsqueeze(1)
    stats = []
    for x in client_data:
        hard = torch.cdist(x, centroids).argmin(1)
        resp = torch.nn.functional.one_hot(hard, k).to(x.dtype)
        stats.append({"n_k": resp.sum(0), "s1": resp.T @ x, "s2": resp.T @ (x * x), "n": torch.tensor(float(len(x)))})
    return server_m_step(stats, reg_covar)
