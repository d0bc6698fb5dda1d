"""The contract every client LightningModule fulfils for the Federation."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn


class ClientModule(L.LightningModule):
    """Base class of client modules.

    The Federation keeps ONE instance of the client module and loads a client's weights into it
    before each local fit, so a subclass must keep all learnable state in parameters and buffers
    (anything else would leak between clients).

    Subclasses implement ``training_loss`` and ``evaluate``; ``training_step`` here records the
    mean training loss of the fit without a device sync per step. Subclasses pass every input
    batch through ``self.input_norm`` first: an identity by default, a layer that a method
    installs in ``prepare_module`` (HarmoFL's amplitude normalisation) otherwise.

    Attributes:
        primary_metric: The evaluation metric shown in the round line, the final table and curves.
        weighted_batches: Whether a training batch may carry per-sample loss weights, ``(x, y, w)`` (what a method
            that mixes in weighted samples, FedER's replay, checks before it starts).
        lr_factor: Factor of the configured learning rate for the next local fit; a schedule
            (``callbacks.LRSchedule``) sets it before each fit and ``configure_optimizers`` builds the
            optimiser with ``hparams.lr * lr_factor``. 1.0 unless a schedule is configured.

    """

    primary_metric: str = "acc"
    weighted_batches: bool = False

    def __init__(self) -> None:
        super().__init__()
        self._loss_sum: Tensor | None = None
        self._loss_count = 0
        # Extra training-loss terms that callbacks register (e.g. MOON's contrastive term); each is called
        # with the outputs of the batch's forward pass and returns a scalar added to the loss.
        self.loss_terms: dict[str, Callable[..., Tensor]] = {}
        self.input_norm: nn.Module = nn.Identity()
        # Not a hyper-parameter nor state: a pure function of the round, set again before every fit.
        self.lr_factor: float = 1.0

    @abstractmethod
    def training_loss(self, batch: Any) -> Tensor:
        """The scalar loss of one training batch."""

    @abstractmethod
    def evaluate(self, batches: Iterable[Any], device: torch.device) -> dict[str, float]:
        """Metrics of the current weights over ``batches`` (eval mode, no gradients)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """One local step; the loss is accumulated for the round report.

        The loss is deliberately not passed to ``self.log``: Lightning moves its logged-results
        collection between devices at the end of every fit, which cost ~8 ms per client fit (10 % of
        the digits benchmark); the Federation logs the per-client mean instead.
        """
        loss = self.training_loss(batch)
        detached = loss.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._loss_count += 1
        return loss

    def on_train_start(self) -> None:
        """Reset the loss accumulator: one client's local training starts (also within a round fit)."""
        self._loss_sum, self._loss_count = None, 0

    def fit_report(self) -> dict[str, float]:
        """Mean training loss and number of steps of the last client's training (``nan`` loss if no step ran)."""
        if self._loss_sum is None:
            return {"train_loss": math.nan, "train_steps": 0}
        return {"train_loss": float(self._loss_sum) / self._loss_count, "train_steps": self._loss_count}


@torch.inference_mode()
def eval_outputs(module: nn.Module, batches: Iterable[Any], device: torch.device) -> tuple[Tensor, Tensor] | None:
    """``module``'s float outputs and the targets over every ``(x, y, ...)`` batch, concatenated, in eval mode.

    The module's train/eval flag is restored afterwards. None when there is no batch.
    """
    was_training = module.training
    module.eval()
    outputs, targets = [], []
    for batch in batches:
        x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        outputs.append(module(x).float())
        targets.append(y)
    module.train(was_training)
    if not outputs:
        return None
    return torch.cat(outputs), torch.cat(targets)


def concat_parts(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Several test sets' prediction parts as one, each key concatenated in the given order (on the first's device)."""
    return {k: torch.cat([p[k].to(parts[0][k].device) for p in parts]) for k in parts[0]}
