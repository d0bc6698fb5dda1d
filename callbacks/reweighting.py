"""Reweighting: class-weighted cross-entropy against each client's label imbalance."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.label_shift import inverse_prior_weights

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext
    from fl_lightning.wire.protocol import Reply

WEIGHT_KEY = "class_weight"


class Reweighting(FederatedCallback):
    """Each client weights its cross-entropy by w_c ∝ 1/π_{i,c} (mean 1 over the classes it holds).

    π_{i,c} is the Laplace-smoothed prior of FedShift, computed by each client from its own label counts
    (a client-only method: nothing travels). The weights live in the client module's ``class_weight`` buffer
    (private, never averaged) and only the training loss reads them. A client whose weights are all equal
    (balanced data) trains exactly as in FedAvg.
    """

    @override
    def private_keys(self, module: L.LightningModule) -> set[str]:
        if WEIGHT_KEY not in module.state_dict() or not hasattr(module, "use_class_weight"):
            raise PreconditionError(f"Reweighting needs a client module with a `{WEIGHT_KEY}` buffer")
        return {WEIGHT_KEY}

    @staticmethod
    def client_weights(ctx: ClientContext) -> torch.Tensor:
        """The client's class weights, from its own label counts."""
        return inverse_prior_weights(ctx.data.label_counts(ctx.client_id)).float()

    @override
    def on_client_start(self, ctx: ClientContext, module: L.LightningModule) -> None:
        w = self.client_weights(ctx)
        getattr(module, WEIGHT_KEY).copy_(w)
        module.use_class_weight = not bool(torch.all(w == w[0]))  # uniform weights change nothing: skip them

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        module.use_class_weight = False
