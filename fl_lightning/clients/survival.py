"""Survival client: a Cox proportional-hazards model (linear or MLP risk) trained on the partial likelihood."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from fl_lightning.clients.base import ClientModule, concat_parts, eval_outputs
from fl_lightning.clients.optim import configured_optimizer
from fl_lightning.models.cox import CoxArch, CoxNet
from fl_lightning.ops.survival import concordance_index, cox_partial_likelihood


class SurvivalClient(ClientModule):
    """A client that trains a Cox model on table rows with survival labels ``(time, event)``.

    The network gives each row a risk score r = f(x) (higher = shorter expected survival). Training minimises the
    negative Cox partial log-likelihood of the batch (Breslow ties, per event;
    :func:`~fl_lightning.ops.survival.cox_partial_likelihood`): each batch's risk sets are its own samples, the
    usual minibatch estimate. A batch without an event has no partial likelihood and gives a zero loss whose
    gradients are zero. Evaluation scores Harrell's C-index (:func:`~fl_lightning.ops.survival.concordance_index`)
    and the partial likelihood over the whole test set at once.

    Batches are ``(x, y)``: x float32 (B, F), y float32 (B, 2) holding (time, event) with event 1 observed and 0
    censored (the survival datamodules' ``label_kind = "survival"``).

    Args:
        num_features: Feature columns F (linked from the data: ``data.num_features``).
        num_classes: Linked from the data like every client's (a survival datamodule says 2: censored and event);
            unused here.
        arch: ``linear`` (the Cox model r = x·β, no bias: it cancels in the partial likelihood) or ``mlp`` (one
            hidden layer of ``width`` ReLU units, then a bias-free linear risk).
        width: Hidden units of the MLP.
        optimizer: Local optimiser: ``sgd``, ``adam`` or ``adamw``.
        lr: Local learning rate η.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 weight decay of the local optimiser.

    Raises:
        ValueError: On a bad argument, naming its config key.
    """

    primary_metric = "c_index"

    def __init__(
        self,
        num_features: int = 13,
        num_classes: int = 2,
        arch: CoxArch = "linear",
        width: int = 32,
        optimizer: Literal["sgd", "adam", "adamw"] = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"model.init_args.lr must be positive, got {lr}")
        self.save_hyperparameters()
        self.net = CoxNet(num_features, arch, width)

    def forward(self, x: Tensor) -> Tensor:
        """Risk scores, shape (N,)."""
        return self.net(self.input_norm(x))

    def training_loss(self, batch: Any) -> Tensor:
        """Negative partial log-likelihood of the batch ``(x, (time, event))``, plus registered loss terms.

        With loss terms registered, the terms get the representation (``net.features``) of the same forward pass;
        ``logits`` is then the (N,) risk.
        """
        x, y = batch[0], batch[1]
        normalized = None
        if self.loss_terms:
            normalized = self.input_norm(x)
            features = self.net.features(normalized)
            risk = self.net.classifier(features).squeeze(-1)
        else:
            features, risk = None, self(x)
        loss = cox_partial_likelihood(risk, y[:, 0], y[:, 1])
        for term in self.loss_terms.values():
            loss = loss + term(x=x, y=y, logits=risk, features=features, x_normalized=normalized)
        return loss

    def evaluate(self, batches: Iterable[Any], device: torch.device) -> dict[str, float]:
        """Cox loss and C-index over all ``batches``, computed once over the concatenated predictions.

        Both depend on every pair of samples (risk sets, comparable pairs), so neither is a mean over batches: they
        are exact whatever the batch size.
        """
        parts = self.evaluation_parts(batches, device)
        return self.metrics_from_parts(parts) if parts else {}

    def evaluation_parts(self, batches: Iterable[Any], device: torch.device) -> dict[str, Tensor]:
        """What pooled metrics need from one test set: its risks and (time, event) labels (empty dict for no batch).

        Predictions leave a client only over an in-process transport (simulation); see README "The
        client/server boundary".
        """
        out = eval_outputs(self, batches, device)
        return {} if out is None else {"risk": out[0], "targets": out[1]}

    pooled_parts_are_predictions = True  # the pooled C-index needs every test prediction (a simulation only)

    @staticmethod
    def merge_parts(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """Several test sets' parts as one (concatenated in the given order): the pooled set's predictions."""
        return concat_parts(parts)

    def metrics_from_parts(self, parts: dict[str, Tensor]) -> dict[str, float]:
        """The metrics of :meth:`evaluate` from (merged) parts: ``loss`` and ``c_index``.

        Either is ``nan`` where it is undefined: the loss of a set without an event (training's zero would rank as
        the best loss), the C-index of a set without a comparable pair.
        """
        risk, time, event = parts["risk"], parts["targets"][:, 0], parts["targets"][:, 1]
        loss = cox_partial_likelihood(risk, time, event).item() if bool((event != 0).any()) else math.nan
        return {"loss": loss, "c_index": concordance_index(risk, time, event)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """A fresh local optimiser for each client fit (FedAvg's usual choice); learning rate ``lr · lr_factor``."""
        return configured_optimizer(self)
