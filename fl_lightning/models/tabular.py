"""Networks for tables: logistic regression and a small MLP over F feature columns."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

TABLE_ARCHITECTURES = ("logistic", "mlp")
TableNorm = Literal["batch", "none"]


class BinaryLogit(nn.Module):
    """One score z per sample as the two logits ``[0, z]``: softmax over them is ``sigmoid(z)``.

    Cross-entropy over ``[0, z]`` equals binary cross-entropy on ``sigmoid(z)`` and the arg-max is class 1 exactly
    when ``sigmoid(z) > 0.5``, so a binary model with one output (FLamby's logistic regression, ``nn.Linear(F, 1)``
    with a sigmoid and BCE) is trained and scored as every classifier here is, with the same parameters.
    """

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, 1)

    def forward(self, x: Tensor) -> Tensor:
        """Logits (N, 2) = ``[0, z]``."""
        z = self.linear(x)
        return torch.cat([torch.zeros_like(z), z], dim=1)


def output_layer(in_features: int, num_classes: int) -> nn.Module:
    """A linear output: one score for two classes (:class:`BinaryLogit`), one per class otherwise."""
    return BinaryLogit(in_features) if num_classes == 2 else nn.Linear(in_features, num_classes)


class LogisticRegression(nn.Module):
    """Logistic (binary) or softmax (multi-class) regression on the feature columns.

    ``features`` is the identity (the flattened row) and ``classifier`` the linear output, the representation
    contract that methods such as MOON use.

    Args:
        num_features: Feature columns F.
        num_classes: Classes (2: one output score, see :class:`BinaryLogit`).
    """

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Flatten()
        self.classifier = output_layer(num_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits (N, num_classes)."""
        return self.classifier(self.features(x))


class TabularMLP(nn.Module):
    """Feature columns → ``depth`` hidden layers of ``width`` units (ReLU, optional BatchNorm1d, dropout) → logits.

    Args:
        num_features: Feature columns F.
        num_classes: Classes (2: one output score, see :class:`BinaryLogit`).
        width: Hidden units per layer.
        depth: Hidden layers (>= 1).
        norm: ``batch`` (BatchNorm1d after each hidden linear layer: FedBN keeps them private) or ``none``.
        dropout: Dropout probability after each hidden layer.
    """

    def __init__(
        self, num_features: int, num_classes: int, width: int = 32, depth: int = 1, norm: TableNorm = "none",
        dropout: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        if depth < 1:
            raise ValueError(f"model.init_args.depth must be >= 1, got {depth}")
        if width < 1:
            raise ValueError(f"model.init_args.width must be >= 1, got {width}")
        if not 0.0 <= dropout < 1.0:  # torch's own message would not name the key; 1 would drop every unit
            raise ValueError(f"model.init_args.dropout must be in [0, 1), got {dropout}")
        if norm not in ("batch", "none"):
            raise ValueError(f"model.init_args.norm for a table must be 'batch' or 'none', got {norm!r}")
        layers: list[nn.Module] = [nn.Flatten()]
        size = num_features
        for _ in range(depth):
            layers.append(nn.Linear(size, width))
            if norm == "batch":
                layers.append(nn.BatchNorm1d(width))
            layers.append(nn.ReLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
            size = width
        self.features = nn.Sequential(*layers)
        self.classifier = output_layer(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits (N, num_classes)."""
        return self.classifier(self.features(x))


def build_table_classifier(
    arch: str, num_features: int, num_classes: int, width: int = 32, depth: int = 1, norm: TableNorm = "none",
    dropout: float = 0.0,
) -> nn.Module:  # fmt: skip
    """A network for rows of ``num_features`` columns, by name (``logistic`` or ``mlp``).

    Raises:
        ValueError: On an unknown architecture, fewer than 2 classes, or a bad MLP setting, naming the key.
    """
    if num_classes < 2:
        raise ValueError(f"model.init_args.num_classes must be >= 2 (linked from the data), got {num_classes}")
    if arch == "logistic":
        return LogisticRegression(num_features, num_classes)
    if arch == "mlp":
        return TabularMLP(num_features, num_classes, width=width, depth=depth, norm=norm, dropout=dropout)
    raise ValueError(f"model.init_args.arch must be one of {TABLE_ARCHITECTURES}, got {arch!r}")
