"""FedNova: normalised averaging for clients that take different numbers of local steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import plain_sgd, trainable_names
from fl_lightning.ops.fednova import normalized_update, normalizing_factor, server_step

if TYPE_CHECKING:
    from fl_lightning.federation import ClientUpdate, Federation, ModelGroup
    from fl_lightning.ops.state import StateDict


class FedNova(FederatedCallback):
    """FedNova (Wang et al., 2020) on the trainable parameters; buffers are averaged as in FedAvg.

    Each client uploads d_i = (w − w_i)/a_i instead of w_i, with a_i = τ_i for SGD or the momentum
    formula of ../shared/ALGORITHMS.md; the server sets w ← w − τ_eff Σ p_i d_i, τ_eff = Σ p_i a_i.
    With equal step counts this is FedAvg. The learning rate η does not appear: d_i carries η_i, and as
    every client of a round trains with the same η (also under a per-round schedule, callbacks.LRSchedule)
    the server step needs no η of its own.

    Preconditions (checked before the first round): local SGD (momentum allowed, no Nesterov), one
    optimiser step per batch.
    """

    def __init__(self) -> None:
        super().__init__()
        self._momentum = 0.0
        self._names: list[str] = []
        self._tau_eff = 0.0
        self._weight = 0.0

    @override
    def on_federation_start(self, federation: Federation) -> None:
        group = plain_sgd(federation.module, federation.trainer, "FedNova", allow_momentum=True)
        self._momentum = float(group.get("momentum", 0.0))
        self._names = trainable_names(federation.module)

    @override
    def on_round_start(self, federation: Federation, round_idx: int, selected: list[str]) -> None:
        self._tau_eff, self._weight = 0.0, 0.0

    @override
    def on_client_end(
        self, federation: Federation, client_id: str, module: L.LightningModule, update: ClientUpdate
    ) -> None:
        a = normalizing_factor(update.num_steps, self._momentum)
        w_global = next(g for g in federation.groups if g.name == update.group).state
        params = {k: w_global[k] for k in self._names}
        update.state.update(normalized_update(params, {k: update.state[k] for k in self._names}, a))
        self._tau_eff += update.weight * a
        self._weight += update.weight

    @override
    def on_aggregate(
        self, federation: Federation, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        # averaged[k] holds Σ p_i d_i for the parameters (renormalised if clients dropped out); so must τ_eff be.
        tau_eff = self._tau_eff / self._weight
        stepped = server_step({k: previous[k] for k in self._names}, {k: averaged[k] for k in self._names}, tau_eff)
        return {**averaged, **stepped}
