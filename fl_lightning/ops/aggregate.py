"""Weighted averaging of client states (FedAvg's server step)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from fl_lightning.ops.state import StateDict

WeightScheme = Literal["samples", "uniform"]


def aggregation_weights(num_samples: Sequence[int], scheme: WeightScheme = "samples") -> list[float]:
    """Normalised aggregation weights p_i.

    Args:
        num_samples: Training samples n_i of each participating client.
        scheme: ``"samples"`` for p_i = n_i / n (FedAvg), ``"uniform"`` for p_i = 1 / K.

    Returns:
        Weights that sum to one.

    Raises:
        ValueError: On an unknown scheme, an empty list, or a zero total.

    """
    if scheme not in ("samples", "uniform"):
        raise ValueError(f"aggregation weights must be 'samples' or 'uniform', got {scheme!r}")
    if not num_samples:
        raise ValueError("cannot aggregate an empty set of clients")
    raw = [float(n) for n in num_samples] if scheme == "samples" else [1.0] * len(num_samples)
    total = sum(raw)
    if total <= 0:
        raise ValueError(f"aggregation weights sum to {total}; every client reported zero samples")
    return [w / total for w in raw]


def weighted_average(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> StateDict:
    """Σ_i p_i · state_i, key by key (the weights are used as given, not re-normalised).

    Integer tensors (e.g. BatchNorm's ``num_batches_tracked``) are averaged in float64 and rounded
    back, so they stay integers.

    Args:
        states: Client states with identical keys.
        weights: One weight per state.

    Returns:
        The averaged state.

    """
    mean = RunningWeightedMean()
    for state, weight in zip(states, weights, strict=True):
        mean.add(state, weight)
    return mean.result()


class RunningWeightedMean:
    """Streaming Σ_i p_i · state_i: the server never holds more than one sum, whatever the client count.

    Floating tensors accumulate in their own dtype promoted to at least float32; integer tensors in float64.
    """

    def __init__(self) -> None:
        self._sum: dict[str, Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, state: Mapping[str, Tensor], weight: float) -> None:
        """Accumulate ``weight · state``.

        Raises:
            KeyError: If the keys differ from the first state added (names the differing keys).

        """
        if self.count and set(state) != set(self._sum):
            diff = sorted(set(state) ^ set(self._sum))
            raise KeyError(f"client state keys differ from the first client's: {diff[:5]}")
        for key, value in state.items():
            value = value.detach()
            acc_dtype = torch.promote_types(value.dtype, torch.float32) if value.is_floating_point() else torch.float64
            term = value.to(acc_dtype) * weight
            if key in self._sum:
                self._sum[key].add_(term.to(self._sum[key].device))
            else:
                self._sum[key] = term  # a fresh tensor: `.to(...) * weight` never aliases the input
                self._dtypes[key] = value.dtype
        self.total_weight += weight
        self.count += 1

    def result(self, normalize: bool = False) -> StateDict:
        """The accumulated sum, cast back to each key's original dtype.

        Args:
            normalize: Divide by the total weight first (Σ_i w_i · state_i / Σ_i w_i), before integer
                tensors are rounded, so they are re-normalised too.

        Raises:
            ValueError: If nothing was added.

        """
        if not self.count:
            raise ValueError("no client state was added to the aggregate")
        out: StateDict = {}
        for key, value in self._sum.items():
            dtype = self._dtypes[key]
            if normalize:
                value = value / self.total_weight
            out[key] = value.to(dtype) if dtype.is_floating_point else value.round().to(dtype)
        return out
