"""FedNova: normalised averaging that removes the bias of unequal local step counts."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def normalizing_factor(steps: int, momentum: float = 0.0) -> float:
    """a_i = τ_i for plain SGD; [τ_i − ρ(1 − ρ^τ_i)/(1 − ρ)] / (1 − ρ) with momentum ρ."""
    if steps <= 0:
        raise ValueError(f"FedNova needs a positive number of local steps, got {steps}")
    if momentum == 0:
        return float(steps)
    rho = momentum
    return (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)


def normalized_update(w_global: Mapping[str, Tensor], w_local: Mapping[str, Tensor], a: float) -> dict[str, Tensor]:
    """d_i = (w − w_i) / a_i."""
    return {k: (w_global[k] - w_local[k]) / a for k in w_global}


def server_step(w_global: Mapping[str, Tensor], mean_update: Mapping[str, Tensor], tau_eff: float) -> dict[str, Tensor]:
    """Server step: w ← w − τ_eff Σ_i p_i d_i, with τ_eff = Σ_i p_i a_i."""
    return {k: w_global[k] - tau_eff * mean_update[k] for k in mean_update}
