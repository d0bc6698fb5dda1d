"""FedNova: normalised averaging for clients that take different numbers of local steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import plain_sgd, trainable_names
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.fednova import normalized_update, normalizing_factor, server_step

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, ModelGroup, RuntimeView, ServerView
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Reply, Task


class FedNova(FederatedCallback):
    """FedNova (Wang et al., 2020) on the trainable parameters; buffers are averaged as in FedAvg.

    Each client uploads d_i = (w − w_i)/a_i instead of w_i (client half), with a_i = τ_i for SGD or the
    momentum formula of ../shared/ALGORITHMS.md, and a_i as its payload; the server sets
    w ← w − τ_eff Σ p_i d_i, τ_eff = Σ p_i a_i. With equal step counts this is FedAvg. The learning rate η
    does not appear: d_i carries η_i, and as every client of a round trains with the same η (also under a
    per-round schedule, callbacks.LRSchedule) the server step needs no η of its own.

    Preconditions (checked before the first round): local SGD (momentum allowed, no Nesterov), one
    optimiser step per batch, and no kept optimiser state with momentum (a_i assumes the momentum buffer
    starts at zero in every fit; ``federation.keep_optimizer_state`` would carry it over).
    """

    server_step = "fednova"

    def __init__(self) -> None:
        super().__init__()
        self._momentum = 0.0
        self._tau_eff = 0.0
        self._weight = 0.0
        self._names: list[str] = []  # server half: the trainable parameters
        self._client_names: list[str] = []  # client half: the same, of the runtime's module

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: ServerView) -> None:
        self._names = trainable_names(server.module)

    @override
    def on_round_start(self, server: ServerView, round_idx: int, selected: list[str]) -> None:
        self._tau_eff, self._weight = 0.0, 0.0

    @override
    def on_reply(self, server: ServerView, task: Task, reply: Reply, weight: float) -> None:
        self._tau_eff += weight * float(self.get_payload(reply))
        self._weight += weight

    @override
    def on_aggregate(
        self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        # averaged[k] holds Σ p_i d_i for the parameters (renormalised if clients dropped out); so must τ_eff be.
        tau_eff = self._tau_eff / self._weight
        stepped = server_step({k: previous[k] for k in self._names}, {k: averaged[k] for k in self._names}, tau_eff)
        return {**averaged, **stepped}

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        group = plain_sgd(runtime.module, runtime.trainer, "FedNova", allow_momentum=True)
        self._momentum = float(group.get("momentum", 0.0))
        self._client_names = trainable_names(runtime.module)
        if self._momentum and runtime.keep_optimizer_state:
            raise PreconditionError(
                f"FedNova's normalising factor assumes the momentum buffer starts at zero in every local fit; with "
                f"momentum={self._momentum} and a kept optimiser state (federation.keep_optimizer_state=true, or "
                "mode local/centralized) it does not. Set federation.keep_optimizer_state=false or model.momentum=0"
            )

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        a = normalizing_factor(reply.num_steps, self._momentum)
        params = {k: ctx.received[k] for k in self._client_names}
        reply.state.update(normalized_update(params, {k: reply.state[k] for k in self._client_names}, a))
        self.put_payload(reply, a)
