"""Tabular classification client: logistic regression or an MLP over a clinical table's feature columns."""

from __future__ import annotations

from typing import Literal

from fl_lightning.clients.classification import ClassificationClient
from fl_lightning.models.tabular import TableNorm, build_table_classifier


class TabularClient(ClassificationClient):
    """A client that trains a classifier on table rows (N, F) with cross-entropy; binary models have one score.

    Everything but the network is :class:`~fl_lightning.clients.ClassificationClient`'s: the loss (with the
    label-skew methods' modifiers and registered terms), the metrics (loss, accuracy at 0.5 for a binary model,
    balanced accuracy, macro-F1, AUROC), the pooled evaluation and the optimiser. A binary model
    (``num_classes`` = 2) has one output z per row, trained with binary cross-entropy on ``sigmoid(z)``
    (:class:`~fl_lightning.models.tabular.BinaryLogit`).

    Args:
        num_classes: Classes (linked from the data).
        num_features: Feature columns F (linked from the data: ``data.num_features``, after one-hot encoding).
        arch: ``logistic`` (logistic regression, the default) or ``mlp``.
        width: Hidden units of the MLP.
        depth: Hidden layers of the MLP.
        norm: ``batch`` (BatchNorm1d in the MLP's hidden layers, private under FedBN) or ``none``.
        dropout: Dropout of the MLP's hidden layers.
        optimizer: Local optimiser: ``sgd``, ``adam`` or ``adamw``.
        lr: Local learning rate η.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 weight decay of the local optimiser.
    """

    def __init__(
        self,
        num_classes: int = 2,
        num_features: int = 13,
        arch: Literal["logistic", "mlp"] = "logistic",
        width: int = 32,
        depth: int = 1,
        norm: TableNorm = "none",
        dropout: float = 0.0,
        optimizer: Literal["sgd", "adam", "adamw"] = "sgd",
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        if num_features < 1:
            raise ValueError(f"model.init_args.num_features must be >= 1, got {num_features}")
        net = build_table_classifier(arch, num_features, num_classes, width=width, depth=depth, norm=norm,
                                     dropout=dropout)  # fmt: skip
        # A row is given to the shape check as a 1 × F image, which the nets flatten back to F values.
        super().__init__(
            num_classes=num_classes,
            in_channels=1,
            image_size=(1, num_features),
            optimizer=optimizer,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            net=net,
        )
