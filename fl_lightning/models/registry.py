"""Build a classification network by name, so configs can pick one with a string."""

from __future__ import annotations

from torch import nn

from fl_lightning.models.cnn import MLP, NormKind, SmallCNN

ARCHITECTURES = ("cnn", "mlp")


def build_classifier(
    arch: str,
    in_channels: int,
    num_classes: int,
    image_size: tuple[int, int],
    width: int = 32,
    norm: NormKind = "batch",
) -> nn.Module:
    """A classification network.

    Args:
        arch: ``"cnn"`` (SmallCNN) or ``"mlp"``.
        in_channels: Image channels.
        num_classes: Output classes.
        image_size: Input (height, width); the MLP needs it for its input layer.
        width: Channels of the CNN's first block, or hidden units of the MLP.
        norm: Normalisation layers of the CNN (the MLP has none).

    Raises:
        ValueError: On an unknown architecture name.

    """
    if arch == "cnn":
        return SmallCNN(in_channels, num_classes, image_size, width=width, norm=norm)
    if arch == "mlp":
        return MLP(in_channels * image_size[0] * image_size[1], num_classes, hidden=width)
    raise ValueError(f"model.arch must be one of {ARCHITECTURES}, got {arch!r}")
