"""Federated diagonal Gaussian mixtures: clients compute sufficient statistics, the server does the M-step.

No data point leaves a client: a client sends only Σγ, Σγx and Σγx² per component (and, for the
k-means initialisation, per-centroid counts and sums).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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


# A client round-trip: ``ask(name, payload)`` puts the question to every client and returns their answers in
# client order (``None`` from a client with no data for it). In one process it is a loop over tensors
# (:func:`local_clients`); in a federation it is one query task per client.
Ask = Callable[[str, Any], list[Any]]


def client_answer(x: Tensor, name: str, payload: Any) -> Any:
    """One client's answer to a step of federated k-means or EM on its data ``x`` (``None`` if it has none).

    ``moments``: Σx, Σx², n. ``kmeans``: per-centroid counts and sums. ``hard_stats``: the M-step statistics
    of the hard k-means assignment. ``estep``: the E-step statistics under a mixture.
    """
    if not len(x):
        return None
    if name == "moments":
        return {"n": len(x), "sum": x.sum(0), "sumsq": (x * x).sum(0)}
    if name in ("kmeans", "hard_stats"):
        centroids = payload
        hard = torch.cdist(x, centroids).argmin(1)
        k = len(centroids)
        if name == "kmeans":
            return {
                "counts": torch.bincount(hard, minlength=k).to(x.dtype),
                "sums": torch.zeros_like(centroids).index_add_(0, hard, x),
            }
        resp = torch.nn.functional.one_hot(hard, k).to(x.dtype)
        return {"n_k": resp.sum(0), "s1": resp.T @ x, "s2": resp.T @ (x * x), "n": torch.tensor(float(len(x)))}
    if name == "estep":
        return client_statistics(x, DiagonalGMM(**payload))
    raise KeyError(f"no federated GMM step {name!r}")


def local_clients(client_data: Sequence[Tensor]) -> Ask:
    """``ask`` over clients simulated in one process (their data in a list)."""
    return lambda name, payload: [client_answer(x, name, payload) for x in client_data]


def gmm_payload(gmm: DiagonalGMM) -> dict[str, Tensor]:
    """A mixture as plain tensors (what the server sends for an E-step)."""
    return {"weights": gmm.weights, "means": gmm.means, "variances": gmm.variances}


def federated_em_over(
    ask: Ask, init: DiagonalGMM, max_iter: int = 100, tol: float = 1e-3, reg_covar: float = 1e-6
) -> tuple[DiagonalGMM, int]:
    """EM over clients until the mean log-likelihood improves by less than ``tol`` (scikit-learn's rule).

    Returns:
        The fitted mixture and the number of iterations run.
    """
    gmm, previous = init, -math.inf
    for it in range(1, max_iter + 1):
        stats = [s for s in ask("estep", gmm_payload(gmm)) if s is not None]  # on each client
        mean_ll = float(sum(s["log_likelihood"] for s in stats) / sum(s["n"] for s in stats))
        gmm = server_m_step(stats, reg_covar)  # on the server
        if abs(mean_ll - previous) < tol:
            return gmm, it
        previous = mean_ll
    return gmm, max_iter


def federated_em(
    client_data: Sequence[Tensor], init: DiagonalGMM, max_iter: int = 100, tol: float = 1e-3, reg_covar: float = 1e-6
) -> tuple[DiagonalGMM, int]:
    """:func:`federated_em_over` clients simulated in one process."""
    return federated_em_over(local_clients(client_data), init, max_iter, tol, reg_covar)


def federated_kmeans_init_over(ask: Ask, k: int, seed: int, iters: int = 10, reg_covar: float = 1e-6) -> DiagonalGMM:
    """Initial mixture by federated k-means.

    The server seeds k centroids from the global mean and standard deviation (themselves from
    client sums), then runs Lloyd iterations on per-centroid counts and sums sent by the clients;
    the resulting hard assignments give the initial weights, means and variances.
    """
    moments = [m for m in ask("moments", None) if m is not None]
    n = sum(m["n"] for m in moments)
    total = sum(m["sum"] for m in moments)
    total_sq = sum(m["sumsq"] for m in moments)
    mean = total / n
    std = (total_sq / n - mean**2).clamp_min(0).sqrt()
    g = torch.Generator().manual_seed(seed)
    centroids = mean + std * torch.randn(k, len(mean), generator=g, dtype=mean.dtype)
    for _ in range(iters):
        counts, sums = torch.zeros(k, dtype=mean.dtype), torch.zeros_like(centroids)
        for answer in ask("kmeans", centroids.clone()):  # client side: nearest centroid, counts and sums
            if answer is not None:
                counts += answer["counts"]
                sums += answer["sums"]
        nonempty = counts > 0
        centroids[nonempty] = sums[nonempty] / counts[nonempty].unsqueeze(1)
    stats = [s for s in ask("hard_stats", centroids.clone()) if s is not None]
    return server_m_step(stats, reg_covar)


def federated_kmeans_init(
    client_data: Sequence[Tensor], k: int, seed: int, iters: int = 10, reg_covar: float = 1e-6
) -> DiagonalGMM:
    """:func:`federated_kmeans_init_over` clients simulated in one process."""
    return federated_kmeans_init_over(local_clients(client_data), k, seed, iters, reg_covar)
