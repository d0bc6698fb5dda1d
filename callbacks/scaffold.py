"""SCAFFOLD (option II): control variates correct the client drift of local SGD."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import plain_sgd, trainable_names
from fl_lightning.ops.scaffold import client_control, correct_gradients, server_control

if TYPE_CHECKING:
    from fl_lightning.federation import Federation
    from fl_lightning.ops.state import StateDict
    from fl_lightning.protocol import Reply, Task
    from fl_lightning.runtime import ClientContext, ClientRuntime
    from fl_lightning.state import ModelGroup


class Scaffold(FederatedCallback):
    """SCAFFOLD with option II control variates and global step size η_g = 1.

    Each local gradient is corrected by c − c_i; after the fit, c_i⁺ = c_i − c + (w − w_i)/(τ_i η);
    the server sets c ← c + Σ_{i∈S}(c_i⁺ − c_i)/N; η is the learning rate of that fit (the round's under a
    per-round schedule). Control variates cover the trainable parameters.

    Messages: every ``fit`` task carries c; every reply carries Δc_i = c_i⁺ − c_i (so a round moves about
    twice FedAvg's bytes each way). c_i is the client's private state (``ctx.state["c_i"]``, kept by its
    runtime while it is idle and saved in checkpoints); c is the server half's state.

    Preconditions (checked before the first round): plain SGD without momentum, one optimiser step
    per batch. One model group (the server control variate is per federation).

    Args:
        update_controls: Update c and c_i after each round; with False they stay zero, which is FedAvg.

    """

    server_step = "scaffold"  # the plain average, with c updated from the clients' local SGD steps

    def __init__(self, update_controls: bool = True) -> None:
        super().__init__()
        self.update_controls = update_controls
        self.c: dict[str, torch.Tensor] = {}
        self._delta_sum: dict[str, torch.Tensor] = {}
        self._ctx: ClientContext | None = None
        self._params: list[torch.Tensor] = []
        self._corrections: list[torch.Tensor] = []
        self._lr = 0.0

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: Federation) -> None:
        if len(server.groups) != 1:
            raise ValueError("Scaffold supports one model group")
        if not self.c:  # a resumed run restored it already
            state = server.groups[0].state
            self.c = {k: torch.zeros_like(state[k]) for k in trainable_names(server.module)}

    @override
    def configure_task(self, server: Federation, task: Task) -> None:
        self.put_payload(task, self.c)

    @override
    def on_reply(self, server: Federation, task: Task, reply: Reply, weight: float) -> None:
        delta = self.get_payload(reply)
        if not delta:
            return
        for k, d in delta.items():
            self._delta_sum[k] = self._delta_sum[k] + d if k in self._delta_sum else d

    @override
    def on_aggregate(
        self, server: Federation, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        if self.update_controls and self._delta_sum:
            self.c = server_control(self.c, self._delta_sum, len(server.data.client_ids))
        self._delta_sum = {}
        return averaged  # η_g = 1: w + Σ p_i (w_i − w) is the weighted average

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"c": self.c}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.c = dict(state_dict["c"])

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: ClientRuntime) -> None:
        plain_sgd(runtime.module, runtime.trainer, "SCAFFOLD", allow_momentum=False)
        self._names = trainable_names(runtime.module)

    @override
    def on_client_start(self, ctx: ClientContext, module: L.LightningModule) -> None:
        self._ctx = ctx

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        named = dict(pl_module.named_parameters())
        c, c_i = self._ctx.payload, self._ctx.state.get("c_i", {})
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
        self._ctx = None
        if not self.update_controls:
            return
        c = ctx.payload
        c_i = ctx.state.get("c_i") or {k: torch.zeros_like(v) for k, v in c.items()}
        c_new = client_control(c_i, c, ctx.received, reply.state, reply.num_steps, self._lr)
        self.put_payload(reply, {k: c_new[k] - c_i[k] for k in c})
        ctx.state["c_i"] = c_new
