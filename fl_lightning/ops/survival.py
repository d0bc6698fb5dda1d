"""Survival analysis: the Cox partial likelihood (Breslow ties) and Harrell's concordance index.

Notation: sample j has a risk score r_j = f(x_j) (higher risk = shorter expected survival), an observed time T_j
and an event indicator δ_j (1: the event was observed at T_j, 0: censored at T_j). The risk set of time t is
R(t) = {k : T_k ≥ t}, every sample still followed at t (ties in time included).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# Pairs compared per chunk of the C-index (rows × all samples): about 4 MB per boolean mask, whatever n is.
_PAIRS_PER_CHUNK = 1 << 22


def _check_survival_args(risk: Tensor, time: Tensor, event: Tensor) -> None:
    """Refuse inputs that are not three 1-D tensors of one length, naming the argument."""
    if risk.ndim != 1:
        raise ValueError(f"risk must be 1-D (N,) (one score per sample), got shape {tuple(risk.shape)}")
    for name, value in (("time", time), ("event", event)):
        if tuple(value.shape) != tuple(risk.shape):
            raise ValueError(f"{name} must have the shape of risk {tuple(risk.shape)}, got {tuple(value.shape)}")


def cox_partial_likelihood(risk: Tensor, time: Tensor, event: Tensor) -> Tensor:
    """Negative Cox partial log-likelihood with Breslow's handling of tied times, per event.

    loss = −(1 / Σ_j δ_j) · Σ_{j: δ_j = 1} [ r_j − log Σ_{k: T_k ≥ T_j} exp(r_k) ]

    Breslow: samples with tied times share one risk set (every k with T_k ≥ T_j, the tied ones included), and each
    tied event contributes its own term. Without ties this is the exact partial likelihood (and equals Efron's).
    The log of each risk set's sum is a ``logcumsumexp`` over the samples sorted by descending time, read at the
    last sample of each tie group, so it is stable for large risks and costs O(n log n).

    A set without events has no partial likelihood: the loss is then 0, still attached to the graph
    (``risk.sum() * 0``) so a training step on such a batch runs and changes nothing.

    Args:
        risk: Risk scores r, (N,) floating point; differentiable.
        time: Observed times T, (N,).
        event: Event indicators δ, (N,): nonzero = event observed, 0 = censored.

    Returns:
        The scalar loss, in ``risk``'s dtype.

    Raises:
        ValueError: If the three arguments are not 1-D of one length, naming the argument.
    """
    _check_survival_args(risk, time, event)
    observed = event != 0
    n_events = int(observed.sum())
    if n_events == 0:
        return risk.sum() * 0
    order = torch.argsort(time, descending=True)
    sorted_time = time[order]
    log_cumulative = torch.logcumsumexp(risk[order], dim=0)
    # The cumulative sum at a tie group's last (in descending order) sample covers every k with T_k ≥ T_j.
    _, counts = torch.unique_consecutive(sorted_time, return_counts=True)
    group_end = torch.cumsum(counts, dim=0) - 1
    log_risk_set = log_cumulative[torch.repeat_interleave(group_end, counts)]
    sorted_observed = observed[order]
    log_likelihood = (risk[order] - log_risk_set)[sorted_observed].sum()
    return -log_likelihood / n_events


class ConcordanceCounts(NamedTuple):
    """Harrell's pair counts (integers): concordant, tied-risk and comparable pairs."""

    concordant: int
    tied: int
    comparable: int


def concordance_counts(risk: Tensor, time: Tensor, event: Tensor) -> ConcordanceCounts:
    """Harrell's concordant, tied-risk and comparable pairs, with lifelines' rules for tied times.

    A pair (i, j) is comparable when the earlier one is known to fail first: δ_i = 1 and either T_i < T_j, or
    T_i = T_j with j censored (an event and a censoring at the same time: the censored sample was still at risk).
    Two events at the same time, and pairs whose earlier member is censored, are not comparable. A comparable
    pair is concordant when r_i > r_j (higher risk failed first) and tied when r_i = r_j (exact equality).
    These are the rules of ``lifelines.utils.concordance_index(T, -r, δ)``.

    Vectorised in O(n²) pairs, compared in chunks of rows so memory stays at about 4M pairs whatever n is.

    Args:
        risk: Risk scores r, (N,).
        time: Observed times T, (N,).
        event: Event indicators δ, (N,): nonzero = event observed.

    Returns:
        The three counts.

    Raises:
        ValueError: If the three arguments are not 1-D of one length, naming the argument.
    """
    _check_survival_args(risk, time, event)
    observed = event != 0
    # Only events can be the earlier member of a comparable pair: the rows are the events.
    r_i, t_i = risk[observed], time[observed]
    censored_j = ~observed
    concordant = tied = comparable = 0
    rows = max(1, _PAIRS_PER_CHUNK // max(1, len(risk)))
    for start in range(0, len(r_i), rows):
        ri, ti = r_i[start : start + rows, None], t_i[start : start + rows, None]
        pairs = (ti < time) | ((ti == time) & censored_j)
        comparable += int(pairs.sum())
        concordant += int((pairs & (ri > risk)).sum())
        tied += int((pairs & (ri == risk)).sum())
    return ConcordanceCounts(concordant, tied, comparable)


def concordance_from_counts(counts: ConcordanceCounts) -> float:
    """Harrell's C = (concordant + ½ · tied) / comparable; ``nan`` without a comparable pair."""
    if counts.comparable == 0:
        return float("nan")
    return (counts.concordant + 0.5 * counts.tied) / counts.comparable


def concordance_index(risk: Tensor, time: Tensor, event: Tensor) -> float:
    """Harrell's concordance index of risk scores (higher risk = shorter survival).

    C = (#{comparable (i, j): r_i > r_j} + ½ · #{comparable (i, j): r_i = r_j}) / #{comparable (i, j)}

    with the comparable pairs of :func:`concordance_counts`. 1 orders every comparable pair right, 0.5 is a
    constant (or random) predictor, 0 orders them all wrong. Equals
    ``lifelines.utils.concordance_index(time, -risk, event)``, which takes predicted survival times, hence the sign.

    Args:
        risk: Risk scores r, (N,).
        time: Observed times T, (N,).
        event: Event indicators δ, (N,): nonzero = event observed.

    Returns:
        C in [0, 1], or ``nan`` when no pair is comparable (e.g. no event, or a single sample).

    Raises:
        ValueError: If the three arguments are not 1-D of one length, naming the argument.
    """
    return concordance_from_counts(concordance_counts(risk, time, event))
