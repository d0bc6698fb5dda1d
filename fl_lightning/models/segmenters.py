"""Build a segmentation network by name: the small UNet, or segmentation-models-pytorch's Unet."""

from __future__ import annotations

from torch import nn

from fl_lightning.models.unet import SegNormKind, UNet

SEGMENTERS = ("unet", "smp_unet")


def build_segmenter(
    arch: str,
    in_channels: int,
    num_classes: int,
    image_size: tuple[int, int],
    width: int = 16,
    depth: int = 2,
    norm: SegNormKind = "batch",
    encoder: str = "resnet18",
) -> nn.Module:
    """A network mapping (N, C, H, W) images to (N, num_classes, H, W) logits.

    Args:
        arch: ``"unet"`` (:class:`~fl_lightning.models.unet.UNet`) or ``"smp_unet"``
            (``segmentation_models_pytorch.Unet`` with randomly initialised encoder: nothing is downloaded).
        in_channels: Image channels.
        num_classes: Output classes, background included.
        image_size: Input (height, width); must be divisible by 2**depth.
        width: Channels of the first level (UNet), or of the last decoder block (smp: decoder channels
            ``width·2**(depth−1) … width``).
        depth: Down-sampling steps (UNet), or the smp encoder depth (3 to 5).
        norm: Normalisation of the small UNet (smp's encoder uses its own BatchNorm).
        encoder: smp encoder name (e.g. ``resnet18``, ``mobilenet_v2``).

    Raises:
        ValueError: On an unknown architecture, or an smp depth outside 3–5 or an image size it cannot take.

    """
    if arch == "unet":
        return UNet(in_channels, num_classes, tuple(image_size), width=width, depth=depth, norm=norm)
    if arch == "smp_unet":
        if not 3 <= depth <= 5:
            raise ValueError(f"model.depth must be 3, 4 or 5 with arch=smp_unet, got {depth}")
        h, w = image_size
        if h % 2**depth or w % 2**depth:
            raise ValueError(
                f"smp_unet with depth {depth} needs an image size divisible by {2**depth}, got {image_size}"
            )
        import segmentation_models_pytorch as smp  # slow to import (timm); only when asked for

        return smp.Unet(
            encoder_name=encoder,
            encoder_weights=None,
            encoder_depth=depth,
            decoder_channels=tuple(width * 2**i for i in reversed(range(depth))),
            in_channels=in_channels,
            classes=num_classes,
        )
    raise ValueError(f"model.arch must be one of {SEGMENTERS}, got {arch!r}")
