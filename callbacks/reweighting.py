"""Reweighting: class-weighted cross-entropy against each client's label imbalance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.label_shift import inverse_prior_weights

if TYPE_CHECKING:
    from fl_lightning.federation import ClientUpdate, Federation

WEIGHT_KEY = "class_weight"


class Reweighting(FederatedCallback):
    """Each client weights its cross-entropy by w_c ∝ 1/π_{i,c} (mean 1 over the classes it holds).

    π_{i,c} is the Laplace-smoothed prior of FedShift. The weights live in the client module's
    ``class_weight`` buffer (private, never averaged) and only the training loss reads them. A
    client whose weights are all equal (balanced data) trains exactly as in FedAvg.
    """

    def __init__(self) -> None:
        super().__init__()
        self.weights: dict[str, torch.Tensor] = {}

    @override
    def private_keys(self, module: L.LightningModule) -> set[str]:
        if WEIGHT_KEY not in module.state_dict() or not hasattr(module, "use_class_weight"):
            raise PreconditionError(f"Reweighting needs a client module with a `{WEIGHT_KEY}` buffer")
        return {WEIGHT_KEY}

    @override
    def on_federation_start(self, federation: Federation) -> None:
        self.weights = {
            cid: inverse_prior_weights(federation.data.label_counts(cid)).float() for cid in federation.data.client_ids
        }

    @override
    def on_client_start(self, federation: Federation, client_id: str, module: L.LightningModule) -> None:
        w = self.weights[client_id]
        getattr(module, WEIGHT_KEY).copy_(w)
        module.use_class_weight = not bool(torch.all(w == w[0]))  # uniform weights change nothing: skip them

    @override
    def on_client_end(
        self, federation: Federation, client_id: str, module: L.LightningModule, update: ClientUpdate
    ) -> None:
        module.use_class_weight = False

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.weights = dict(state_dict["weights"])
