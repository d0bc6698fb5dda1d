"""Image classification client."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fl_lightning.clients.base import ClientModule, concat_parts, eval_outputs
from fl_lightning.clients.metrics import classification_metrics
from fl_lightning.clients.optim import configured_optimizer
from fl_lightning.models import build_classifier
from fl_lightning.models.cnn import NormKind
from fl_lightning.models.net_check import DUMMY_BATCH, check_net_shapes


class ClassificationClient(ClientModule):
    """A client that trains an image classifier with cross-entropy.

    Args:
        num_classes: Output classes (linked from the data; not set by hand in configs).
        in_channels: Image channels (linked from the data).
        image_size: Input (height, width) (linked from the data).
        arch: Network: ``cnn`` (two conv blocks, the default) or ``mlp``.
        width: Channels of the CNN's first block or hidden units of the MLP.
        norm: Normalisation layers of the CNN: ``batch``, ``instance``, ``group`` or ``none``.
        optimizer: Local optimiser: ``sgd``, ``adam`` or ``adamw``.
        lr: Local learning rate η.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 weight decay of the local optimiser.
        net: Any ``torch.nn.Module`` mapping (N, in_channels, H, W) images to (N, num_classes) logits, given in a
            config by ``class_path`` and ``init_args`` (e.g. ``monai.networks.nets.DenseNet121``); it replaces the
            built-in network, and ``arch``, ``width`` and ``norm`` are then unused. It is checked before training by
            one forward pass of a dummy batch of the data's shape and refused, with the expected and the actual
            shapes, when it does not take ``in_channels`` channels or does not return ``num_classes`` logits
            (docs: how-to "Medical networks by class path").

    """

    weighted_batches = True  # (x, y, w): the cross-entropy is then Σ_i w_i ℓ_i

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        image_size: tuple[int, int] = (16, 16),
        arch: Literal["cnn", "mlp"] = "cnn",
        width: int = 32,
        norm: NormKind = "batch",
        optimizer: Literal["sgd", "adam", "adamw"] = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        net: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"model.lr must be positive, got {lr}")
        # The net is a module, not a hyper-parameter: its weights are state, its class path is in config.yaml.
        self.save_hyperparameters(ignore=["net"])
        if net is None:
            self.net = build_classifier(arch, in_channels, num_classes, tuple(image_size), width=width, norm=norm)
        else:
            meaning = f"(N, data.num_classes={num_classes}) logits"
            check_net_shapes(net, in_channels, tuple(image_size), (DUMMY_BATCH, num_classes), meaning)
            self.net = net
        # Training-loss modifiers set per client by label-skew methods; never used at evaluation.
        # logit_adjustment is added to the logits in the loss (FedShift); class_weight weights the
        # cross-entropy (Reweighting) when use_class_weight is set. Buffers, so they move with the model.
        self.register_buffer("logit_adjustment", torch.zeros(num_classes))
        self.register_buffer("class_weight", torch.ones(num_classes))
        self.use_class_weight = False

    def forward(self, x: Tensor) -> Tensor:
        """Logits, shape (N, num_classes)."""
        return self.net(self.input_norm(x))

    def training_loss(self, batch: Any) -> Tensor:
        """Cross-entropy of the batch ``(x, y)`` with the per-client loss modifiers, plus registered terms.

        A batch ``(x, y, w)`` carries per-sample loss weights (e.g. FedER's replay samples weighted by λ, see
        ``fl_lightning.ops.replay.join_replay``); the cross-entropy is then Σ_i w_i ℓ_i instead of the mean.

        With loss terms registered, the network must expose ``features`` and ``classifier`` (the
        representation contract of SmallCNN and MLP) so the terms get the representation of the
        same forward pass.
        """
        x, y = batch[0], batch[1]
        normalized = None
        if self.loss_terms:
            normalized = self.input_norm(x)
            features = self.net.features(normalized)
            logits = self.net.classifier(features)
        else:
            features, logits = None, self(x)
        weight = self.class_weight if self.use_class_weight else None
        if len(batch) > 2:
            per_sample = F.cross_entropy(logits + self.logit_adjustment, y, weight=weight, reduction="none")
            loss = (per_sample * batch[2]).sum()
        else:
            loss = F.cross_entropy(logits + self.logit_adjustment, y, weight=weight)
        for term in self.loss_terms.values():
            # ``x_normalized``: the input after input_norm, exactly as this forward pass saw it. A term that runs
            # other networks on the input uses it instead of calling input_norm again (which, in training mode,
            # would update a running statistic such as HarmoFL's amplitude a second time per batch).
            loss = loss + term(x=x, y=y, logits=logits, features=features, x_normalized=normalized)
        return loss

    def evaluate(self, batches: Iterable[Any], device: torch.device) -> dict[str, float]:
        """Loss, accuracy, balanced accuracy, macro-F1 and AUROC over all ``batches``.

        Metrics are computed once over the concatenated predictions (not averaged over batches),
        so they are exact whatever the batch size.
        """
        parts = self.evaluation_parts(batches, device)
        return self.metrics_from_parts(parts) if parts else {}

    def evaluation_parts(self, batches: Iterable[Any], device: torch.device) -> dict[str, Tensor]:
        """What pooled metrics need from one test set: its logits and targets (empty dict for no batch).

        Predictions leave a client only over an in-process transport (simulation); see README "The
        client/server boundary".
        """
        out = eval_outputs(self, batches, device)
        return {} if out is None else {"logits": out[0], "targets": out[1]}

    pooled_parts_are_predictions = True  # pooled metrics need the test predictions (a simulation only)

    @staticmethod
    def merge_parts(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """Several test sets' parts as one (concatenated in the given order)."""
        return concat_parts(parts)

    def metrics_from_parts(self, parts: dict[str, Tensor]) -> dict[str, float]:
        """The metrics of :meth:`evaluate` from (merged) parts."""
        return classification_metrics(parts["logits"], parts["targets"], self.hparams.num_classes)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """A fresh local optimiser for each client fit (FedAvg's usual choice); learning rate ``lr · lr_factor``."""
        return configured_optimizer(self)
