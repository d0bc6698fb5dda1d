"""MR-MTL: personal models only, each pulled towards the mean of all of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import trainable_names
from fl_lightning.ops import add_proximal_gradient, clone_state

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, RuntimeView
    from fl_lightning.wire.protocol import Reply


class MRMTL(FederatedCallback):
    """MR-MTL (Liu, Hu, Wu, Smith, 2022): mean-regularised multi-task learning; only personal models are trained.

    **Client half.** The client trains its own model v_i (the received model at its first fit), not the received
    one, on F_i(v_i) + λ/2 ‖v_i − v̄‖², where v̄ is the received mean of the personal models; the term is added to
    the gradient before each optimiser step as λ(v_i − v̄). It keeps v_i (:attr:`ClientContext.personal`) and
    uploads it.

    **Server half.** FedAvg's weighted mean of the uploads is v̄ (nothing to add); it is what the ``global``
    evaluation scores, and v_i is the ``personal`` model.

    Invariants (``tests/callbacks/test_personal.py``): λ = 0 is local training; every round matches a plain-torch
    reference of the mean-regularised updates.

    Args:
        lam: λ ≥ 0, the pull towards the mean (the paper tunes it per task, 0.01 … 10).
    """

    def __init__(self, lam: float = 0.1) -> None:
        super().__init__()
        if lam < 0:
            raise ValueError(f"MRMTL lam must be >= 0, got {lam}")
        self.lam = lam
        self._names: list[str] = []
        self._step: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        self._names = trainable_names(runtime.module)

    @override
    def on_client_start(self, ctx: ClientContext, module: L.LightningModule) -> None:
        if ctx.personal is not None:
            module.load_state_dict(ctx.personal)  # the client trains its own model, not the received mean

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        named = dict(pl_module.named_parameters())
        params = [named[k] for k in self._names]
        mean = self.fit_context.received
        self._step = (params, [mean[k].to(p.device) for k, p in zip(self._names, params)])

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        add_proximal_gradient(*self._step, self.lam)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = None

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        ctx.personal = clone_state(reply.state)  # before any upload transform (secure aggregation's masks)
