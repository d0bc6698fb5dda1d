"""Label-skew math: Laplace-smoothed priors, FedShift's logit shift, inverse-prior class weights."""

from __future__ import annotations

from torch import Tensor


def smoothed_prior(counts: Tensor) -> Tensor:
    """π_{i,c} = (n_{i,c} + 1) / (n_i + C), float64."""
    counts = counts.double()
    return (counts + 1) / (counts.sum() + counts.numel())


def global_prior(weighted_prior_sum: Tensor, total_samples: float) -> Tensor:
    """π_c = Σ_i (n_i / n) π_{i,c}, from the (secure) sums Σ_i n_i π_{i,c} and n = Σ_i n_i."""
    if total_samples <= 0:
        raise ValueError("the global prior needs at least one training sample")
    return weighted_prior_sum.double() / total_samples


def logit_shift(client_prior: Tensor, global_prior: Tensor, tau: float = 1.0) -> Tensor:
    """FedShift's s_{i,c} = τ (log π_{i,c} − log π_c), added to the logits in the training loss only."""
    return tau * (client_prior.double().log() - global_prior.double().log())


def inverse_prior_weights(counts: Tensor) -> Tensor:
    """Class weights ∝ 1/π_{i,c}, normalised to mean 1 over the classes the client holds."""
    weights = 1.0 / smoothed_prior(counts)
    present = counts > 0
    if not bool(present.any()):
        raise ValueError("a client without any training label cannot be reweighted")
    return weights / weights[present].mean()
