"""A small CNN sized for the embedded digits (16–32 px) and MedMNIST (28 px)."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

NormKind = Literal["batch", "instance", "group", "none"]


def norm_layer(kind: NormKind, channels: int) -> nn.Module:
    """The normalisation layer named by ``kind`` (``none`` gives an identity)."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=True, track_running_stats=True)
    if kind == "group":
        return nn.GroupNorm(min(8, channels), channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be one of batch, instance, group, none; got {kind!r}")


class SmallCNN(nn.Module):
    """Two conv blocks (conv → norm → ReLU → 2×2 max-pool), a hidden linear layer, a linear head.

    The split into ``features`` (the representation) and ``classifier`` is part of the contract
    that representation-based methods (MOON) rely on.

    Args:
        in_channels: Image channels.
        num_classes: Output classes.
        image_size: Input (height, width); both must be divisible by 4.
        width: Channels of the first block (the second has twice as many).
        norm: Normalisation after each convolution.
        hidden: Size of the representation (the hidden linear layer).

    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: tuple[int, int] = (16, 16),
        width: int = 32,
        norm: NormKind = "batch",
        hidden: int = 128,
    ) -> None:
        super().__init__()
        h, w = image_size
        if h % 4 or w % 4:
            raise ValueError(f"SmallCNN needs an image size divisible by 4, got {image_size}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=norm == "none"),
            norm_layer(norm, width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=norm == "none"),
            norm_layer(norm, 2 * width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * (h // 4) * (w // 4), hidden),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (N, num_classes)."""
        return self.classifier(self.features(x))

    def representation(self, x: Tensor) -> Tensor:
        """The feature vector fed to the classifier, shape (N, hidden)."""
        return self.features(x)


class MLP(nn.Module):
    """A two-layer perceptron on flattened images (a fast network for tests and sanity runs).

    Args:
        in_features: Flattened input size C·H·W.
        num_classes: Output classes.
        hidden: Hidden units.

    """

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(inplace=True))
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (N, num_classes)."""
        return self.classifier(self.features(x))

    def representation(self, x: Tensor) -> Tensor:
        """The hidden activations, shape (N, hidden)."""
        return self.features(x)
