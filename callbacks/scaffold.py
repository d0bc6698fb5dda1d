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
    from fl_lightning.federation import ClientUpdate, Federation, ModelGroup
    from fl_lightning.ops.state import StateDict


class Scaffold(FederatedCallback):
    """SCAFFOLD with option II control variates and global step size η_g = 1.

    Each local gradient is corrected by c − c_i; after the fit, c_i⁺ = c_i − c + (w − w_i)/(τ_i η);
    the server sets c ← c + Σ_{i∈S}(c_i⁺ − c_i)/N; η is the learning rate of that fit (the round's under a
    per-round schedule). Control variates cover the trainable parameters; each client's c_i is its
    private state (kept while it is idle, saved in checkpoints).

    Preconditions (checked before the first round): plain SGD without momentum, one optimiser step
    per batch. One model group (the server control variate is per federation).

    Args:
        update_controls: Update c and c_i after each round; with False they stay zero, which is FedAvg.

    """

    def __init__(self, update_controls: bool = True) -> None:
        super().__init__()
        self.update_controls = update_controls
        self.c: dict[str, torch.Tensor] = {}
        self.client_c: dict[str, dict[str, torch.Tensor]] = {}
        self._delta_sum: dict[str, torch.Tensor] = {}
        self._client: str | None = None
        self._params: list[torch.Tensor] = []
        self._corrections: list[torch.Tensor] = []
        self._lr = 0.0

    @override
    def on_federation_start(self, federation: Federation) -> None:
        plain_sgd(federation.module, federation.trainer, "SCAFFOLD", allow_momentum=False)
        if len(federation.groups) != 1:
            raise ValueError("Scaffold supports one model group")
        self._names = trainable_names(federation.module)
        if not self.c:  # a resumed run restored them already
            state = federation.groups[0].state
            self.c = {k: torch.zeros_like(state[k]) for k in self._names}

    @override
    def on_client_start(self, federation: Federation, client_id: str, module: L.LightningModule) -> None:
        self._client = client_id

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        named = dict(pl_module.named_parameters())
        c_i = self.client_c.get(self._client, {})
        self._params = [named[k] for k in self._names]
        self._corrections = [(self.c[k] - c_i[k] if k in c_i else self.c[k]).to(named[k].device) for k in self._names]
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
    def on_client_end(
        self, federation: Federation, client_id: str, module: L.LightningModule, update: ClientUpdate
    ) -> None:
        if not self.update_controls:
            return
        w_global = next(g for g in federation.groups if g.name == update.group).state
        c_i = self.client_c.get(client_id) or {k: torch.zeros_like(v) for k, v in self.c.items()}
        c_new = client_control(c_i, self.c, w_global, update.state, update.num_steps, self._lr)
        for k in self.c:
            delta = c_new[k] - c_i[k]
            self._delta_sum[k] = self._delta_sum[k] + delta if k in self._delta_sum else delta
        self.client_c[client_id] = c_new

    @override
    def on_aggregate(
        self, federation: Federation, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        if self.update_controls and self._delta_sum:
            self.c = server_control(self.c, self._delta_sum, len(federation.data.client_ids))
        self._delta_sum = {}
        return averaged  # η_g = 1: w + Σ p_i (w_i − w) is the weighted average

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"c": self.c, "client_c": self.client_c}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.c = dict(state_dict["c"])
        self.client_c = {cid: dict(v) for cid, v in state_dict["client_c"].items()}
