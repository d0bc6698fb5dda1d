"""FedDyn: a dynamic regulariser that aligns each client's local optimum with the global one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from callbacks.preconditions import single_optimizer, trainable_names
from fl_lightning.callback import FederatedCallback
from fl_lightning.ops.feddyn import add_dynamic_gradient, client_linear_update, server_h_update, server_model

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, ModelGroup, RuntimeView, ServerView
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Reply, Task


class FedDyn(FederatedCallback):
    """FedDyn (Acar et al., ICLR 2021) on the trainable parameters; buffers are averaged as in FedAvg.

    **Client half.** Client i trains on L_i(θ) − ⟨g_i, θ⟩ + (α/2)‖θ − θ^{t−1}‖²: before every optimiser step
    its gradient gets α(θ − θ^{t−1}) − g_i, where θ^{t−1} is the received state and g_i its private linear
    term (``ctx.state["linear"]``, zero before its first round). After the fit, g_i ← g_i − α(θ_i^t − θ^{t−1}).

    **Server half.** From the replies' states (nothing else travels: FedDyn costs FedAvg's bytes) it sums
    θ_i^t − θ^{t−1}, updates h ← h − (α/m) Σ (θ_i^t − θ^{t−1}) over the m clients, and sets the new global
    model to the participants' mean − h/α. The paper's mean is uniform: use it with
    ``federation.aggregation=uniform`` (``configs/feddyn_digits_dirichlet.yaml`` does); with sample weights the mean is
    weighted and the rest unchanged.

    Preconditions: one optimiser, one model group. α = 0 is refused (h/α); small α behaves like FedAvg only
    for the client term, so compare with FedAvg by removing the callback.

    Args:
        alpha: α > 0, the regulariser's weight (the paper's 0.01 … 0.1).

    """

    server_step = "feddyn"

    def __init__(self, alpha: float = 0.01) -> None:
        super().__init__()
        if not alpha > 0:
            raise ValueError(f"FedDyn alpha must be > 0, got {alpha}")
        self.alpha = alpha
        self.h: dict[str, torch.Tensor] = {}
        self._delta_sum: dict[str, torch.Tensor] = {}
        self._names: list[str] = []
        self._step: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None = None

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: ServerView) -> None:
        if len(server.groups) != 1:
            raise ValueError("FedDyn supports one model group")
        if not self.h:  # a resumed run restored it
            state = server.groups[0].state
            self.h = {k: torch.zeros_like(state[k]) for k in trainable_names(server.module)}

    @override
    def on_reply(self, server: ServerView, task: Task, reply: Reply, weight: float) -> None:
        for k in self.h:
            delta = reply.state[k] - task.state[k]
            self._delta_sum[k] = self._delta_sum[k] + delta if k in self._delta_sum else delta

    @override
    def on_aggregate(
        self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        if self._delta_sum:
            self.h = server_h_update(self.h, self._delta_sum, self.alpha, len(server.data.client_ids))
        self._delta_sum = {}
        return server_model(averaged, self.h, self.alpha)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"h": self.h}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.h = dict(state_dict["h"])

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        single_optimizer(runtime.module, "FedDyn")
        self._names = trainable_names(runtime.module)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning moved the module to its device: the anchor θ^{t−1} and g_i live there for the steps.
        named = dict(pl_module.named_parameters())
        params = [named[k] for k in self._names]
        linear = self.fit_context.state.get("linear", {})
        anchors = [p.detach().clone() for p in params]
        terms = [linear[k].to(p.device) if k in linear else torch.zeros_like(p) for k, p in zip(self._names, params)]
        self._step = (params, anchors, terms)

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        add_dynamic_gradient(*self._step, self.alpha)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = None

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        linear = ctx.state.get("linear") or {k: torch.zeros_like(ctx.received[k]) for k in self._names}
        ctx.state["linear"] = client_linear_update(linear, reply.state, ctx.received, self.alpha)
