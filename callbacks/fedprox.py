"""FedProx: a proximal term that keeps local weights near the received global weights."""

from __future__ import annotations

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from fl_lightning.ops import add_proximal_gradient


class FedProx(FederatedCallback):
    """Adds (μ/2)‖w − w_global‖² to every client's loss, as μ(w − w_global) on the gradient.

    The anchor w_global is the weights the client holds when its local fit starts, i.e. what it
    received (plus its private layers, which the term then also keeps near their last value).
    The term is added in ``on_before_optimizer_step``, before gradient clipping and the step.

    Args:
        mu: Proximal coefficient μ ≥ 0; μ = 0 is FedAvg.

    """

    def __init__(self, mu: float = 0.01) -> None:
        super().__init__()
        if mu < 0:
            raise ValueError(f"FedProx mu must be >= 0, got {mu}")
        self.mu = mu
        self._params: list[torch.Tensor] = []
        self._anchors: list[torch.Tensor] = []

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Snapshot after Lightning moved the module to its device, before the first step.
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        self._anchors = [p.detach().clone() for p in self._params]

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        add_proximal_gradient(self._params, self._anchors, self.mu)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._params, self._anchors = [], []  # free the anchor copy between clients
