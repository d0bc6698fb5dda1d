"""FedOpt: an adaptive server optimiser (FedAdam, FedYogi, FedAdagrad) on the averaged update."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import trainable_names
from fl_lightning.ops.fedopt import fedopt_step

if TYPE_CHECKING:
    from fl_lightning.callback import ModelGroup, ServerView
    from fl_lightning.ops.state import StateDict


class FedOpt(FederatedCallback):
    """Server step w ← w + η m/(√v + ε) on the pseudo-gradient Δ = Σ p_i(w_i − w) (Reddi et al., 2021).

    Applies to the trainable parameters; buffers (BatchNorm statistics) take the plain average.
    The moments m and v are the server optimiser's state and are saved in checkpoints. A server-only
    method: it adds nothing to the messages.

    The second moment starts at v₋₁ = ``initial_accumulator``; by default τ² = ``eps``², as in Reddi et al.
    (Alg. 2: v₋₁ ≥ τ²). ``initial_accumulator=0`` starts it at zero (as some implementations do), which makes
    the first steps larger: √v₀ = (1 − β₂)^{1/2}|Δ| for Adam.

    Args:
        optimizer: ``adam`` (FedAdam), ``yogi`` (FedYogi) or ``adagrad`` (FedAdagrad).
        lr: Server learning rate η_g.
        betas: (β₁, β₂).
        eps: ε = τ, the adaptivity floor.
        initial_accumulator: v₋₁ ≥ 0, or ``None`` for τ² = eps² (the paper's).

    """

    server_step = "fedopt"

    def __init__(
        self,
        optimizer: Literal["adam", "yogi", "adagrad"] = "adam",
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-3,
        initial_accumulator: float | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in ("adam", "yogi", "adagrad"):
            raise ValueError(f"FedOpt optimizer must be adam, yogi or adagrad, got {optimizer!r}")
        if lr <= 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"FedOpt needs lr > 0, eps > 0 and betas in [0, 1); got lr={lr}, eps={eps}, betas={betas}")
        if initial_accumulator is not None and initial_accumulator < 0:
            raise ValueError(f"FedOpt initial_accumulator must be >= 0 or null, got {initial_accumulator}")
        self.optimizer, self.lr, self.betas, self.eps = optimizer, lr, tuple(betas), eps
        self.initial_accumulator = eps**2 if initial_accumulator is None else float(initial_accumulator)
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self._names: list[str] = []

    @override
    def on_federation_start(self, server: ServerView) -> None:
        self._names = trainable_names(server.module)

    @override
    def on_aggregate(
        self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        out = dict(averaged)
        for k in self._names:
            w = previous[k]
            delta = averaged[k] - w
            m = self.m.get(k, torch.zeros_like(w))
            v = self.v.get(k, torch.full_like(w, self.initial_accumulator))
            out[k], self.m[k], self.v[k] = fedopt_step(w, delta, m, v, self.optimizer, self.lr, *self.betas, self.eps)
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.m, self.v = dict(state_dict["m"]), dict(state_dict["v"])
