"""SCAFFOLD (option II): control variates correct the client drift of local SGD."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import plain_sgd, trainable_names
from fl_lightning.ops.aggregate import aggregation_weights
from fl_lightning.ops.scaffold import client_control, correct_gradients, server_control, weighted_server_control

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, ModelGroup, RuntimeView, ServerView
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Reply, Task


CONTROL_WEIGHTS = ("steps", "aggregation", "uniform")


class Scaffold(FederatedCallback):
    """SCAFFOLD with option II control variates and global step size η_g = 1.

    Each local gradient is corrected by c − c_i; after the fit, c_i⁺ = c_i − c + (w − w_i)/(τ_i η); η is the
    learning rate of that fit (the round's under a per-round schedule). Control variates cover the trainable
    parameters. The server's control update depends on ``control_weights``:

    * ``"steps"`` (default): c ← c + P · Σ_{i∈S} π_i Δc_i / Σ_{i∈S} π_i with π_i = p_i τ_i, p_i the client's
      aggregation weight over all clients (``federation.aggregation``: n_i/n or 1/N), τ_i its local steps and
      P = Σ_{i∈S} p_i. c is then the mean of the c_i that the aggregated model update actually follows, so the
      corrections cancel in it (Σ_i p_i τ_i (c − c_i) = 0) as they do in the paper. With uniform aggregation and
      equal local steps this is the paper's update.
    * ``"aggregation"``: π_i = p_i (cancels only when every client takes the same number of steps).
    * ``"uniform"``: the paper's c ← c + Σ_{i∈S} Δc_i / N whatever the aggregation weights. With sample-weighted
      aggregation and unequal clients it diverges: c is then the mean of the small clients' one-batch gradients,
      and the large client, which dominates the average, walks τ_i steps along c − c_i
      (``experiments/degenerate.py`` shows it).

    Messages: every ``fit`` task carries c; every reply carries Δc_i = c_i⁺ − c_i (so a round moves about
    twice FedAvg's bytes each way). c_i is the client's private state (``ctx.state["c_i"]``, kept by its
    runtime while it is idle and saved in checkpoints); c is the server half's state.

    Preconditions (checked before the first round): plain SGD without momentum, one optimiser step
    per batch. One model group (the server control variate is per federation).

    Args:
        update_controls: Update c and c_i after each round; with False they stay zero, which is FedAvg.
        control_weights: Weights π_i of the server's control update: ``"steps"``, ``"aggregation"`` or
            ``"uniform"`` (see above).

    """

    server_step = "scaffold"  # the plain average, with c updated from the clients' local SGD steps

    def __init__(
        self, update_controls: bool = True, control_weights: Literal["steps", "aggregation", "uniform"] = "steps"
    ) -> None:
        super().__init__()
        if control_weights not in CONTROL_WEIGHTS:
            raise ValueError(
                f"Scaffold control_weights must be one of {', '.join(CONTROL_WEIGHTS)}, got {control_weights!r}"
            )
        self.update_controls = update_controls
        self.control_weights = control_weights
        self.c: dict[str, torch.Tensor] = {}
        self._delta_sum: dict[str, torch.Tensor] = {}
        self._population: dict[str, float] = {}  # p_i over all clients (the aggregation's scheme)
        self._weight_sum = 0.0  # Σ_{i∈S} π_i
        self._participation = 0.0  # Σ_{i∈S} p_i
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._corrections: list[torch.Tensor] = []
        self._lr = 0.0

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: ServerView) -> None:
        if len(server.groups) != 1:
            raise ValueError("Scaffold supports one model group")
        if not self.c:  # a resumed run restored it already
            state = server.groups[0].state
            self.c = {k: torch.zeros_like(state[k]) for k in trainable_names(server.module)}
        ids = list(server.data.client_ids)
        weights = aggregation_weights([server.num_samples(c) for c in ids], server.config.aggregation)
        self._population = dict(zip(ids, weights, strict=True))

    @override
    def configure_task(self, server: ServerView, task: Task) -> None:
        self.put_payload(task, self.c)

    @override
    def on_reply(self, server: ServerView, task: Task, reply: Reply, weight: float) -> None:
        delta = self.get_payload(reply)
        if not delta:
            return
        if self.control_weights == "uniform":  # the paper's plain sum (divided by N at aggregation)
            pi = 1.0
        else:
            p = self._population[task.client_id]
            pi = p * reply.num_steps if self.control_weights == "steps" else p
            self._participation += p
            delta = {k: d * pi for k, d in delta.items()}
        self._weight_sum += pi
        for k, d in delta.items():
            self._delta_sum[k] = self._delta_sum[k] + d if k in self._delta_sum else d

    @override
    def on_aggregate(
        self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        if self.update_controls and self._delta_sum:
            if self.control_weights == "uniform":
                self.c = server_control(self.c, self._delta_sum, len(server.data.client_ids))
            else:
                self.c = weighted_server_control(self.c, self._delta_sum, self._weight_sum, self._participation)
        self._delta_sum, self._weight_sum, self._participation = {}, 0.0, 0.0
        return averaged  # η_g = 1: w + Σ p_i (w_i − w) is the weighted average

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"c": self.c}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.c = dict(state_dict["c"])

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        plain_sgd(runtime.module, runtime.trainer, "SCAFFOLD", allow_momentum=False)
        self._names = trainable_names(runtime.module)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        named = dict(pl_module.named_parameters())
        ctx = self.fit_context
        c, c_i = ctx.payload, ctx.state.get("c_i", {})
        self._params = [named[k] for k in self._names]
        self._corrections = [(c[k] - c_i[k] if k in c_i else c[k]).to(named[k].device) for k in self._names]
        # η of THIS fit, as configured (a per-round schedule's factor included, see callbacks.LRSchedule), not
        # model.lr: c_i⁺ divides by τ_i η of the steps just taken. A kept optimiser state never restores an old
        # η (the local fitter re-applies the configured one), so the value read here is the one the steps use.
        self._lr = float(trainer.optimizers[0].param_groups[0]["lr"])

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        correct_gradients(self._params, self._corrections)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._params, self._corrections = [], []

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        if not self.update_controls:
            return
        c = ctx.payload
        c_i = ctx.state.get("c_i") or {k: torch.zeros_like(v) for k, v in c.items()}
        c_new = client_control(c_i, c, ctx.received, reply.state, reply.num_steps, self._lr)
        self.put_payload(reply, {k: c_new[k] - c_i[k] for k in c})
        ctx.state["c_i"] = c_new
