"""A small UNet for the embedded segmentation task (16–64 px), with selectable normalisation."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

SegNormKind = Literal["batch", "instance", "group", "none"]


def seg_norm(kind: SegNormKind, channels: int) -> nn.Module:
    """The normalisation layer after each UNet convolution.

    ``instance`` is InstanceNorm with affine parameters and **no** running statistics: each image is
    normalised by its own statistics in training and at test time, which is what makes instance
    normalisation robust to per-image intensity changes (an inverted or low-contrast scan).

    Args:
        kind: ``batch``, ``instance``, ``group`` or ``none``.
        channels: Channels of the layer.

    Raises:
        ValueError: On an unknown kind.

    """
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=True)
    if kind == "group":
        return nn.GroupNorm(min(8, channels), channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"model.norm must be one of batch, instance, group, none; got {kind!r}")


class DoubleConv(nn.Sequential):
    """(3×3 conv → norm → ReLU) twice, size preserved."""

    def __init__(self, in_channels: int, out_channels: int, norm: SegNormKind) -> None:
        bias = norm == "none"
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=bias),
            seg_norm(norm, out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=bias),
            seg_norm(norm, out_channels),
            nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    """Encoder (``depth`` 2×2 max-pools, channels doubling from ``width``), bottleneck, decoder with skip connections.

    Args:
        in_channels: Image channels.
        num_classes: Output classes (logit maps), background included.
        image_size: Input (height, width); both must be divisible by 2**depth.
        width: Channels of the first level.
        depth: Number of down-sampling steps.
        norm: Normalisation after each convolution (see :func:`seg_norm`).

    Raises:
        ValueError: If the image size is not divisible by 2**depth or an argument is not positive.

    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: tuple[int, int] = (32, 32),
        width: int = 16,
        depth: int = 2,
        norm: SegNormKind = "batch",
    ) -> None:
        super().__init__()
        if width < 1 or depth < 1:
            raise ValueError(f"UNet width and depth must be >= 1, got width={width}, depth={depth}")
        h, w = image_size
        if h % 2**depth or w % 2**depth:
            raise ValueError(f"UNet with depth {depth} needs an image size divisible by {2**depth}, got {image_size}")
        chans = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([DoubleConv(in_channels, chans[0], norm)])
        self.down.extend(DoubleConv(chans[i], chans[i + 1], norm) for i in range(depth))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2) for i in reversed(range(depth)))
        self.dec = nn.ModuleList(DoubleConv(2 * chans[i], chans[i], norm) for i in reversed(range(depth)))
        self.head = nn.Conv2d(chans[0], num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (N, num_classes, H, W)."""
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        x = skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)
