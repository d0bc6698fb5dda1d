"""Semantic segmentation client: per-pixel classes, loss CE + soft Dice; Dice, mIoU, HD95 and surface Dice metrics."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassJaccardIndex

from fl_lightning.clients.base import ClientModule
from fl_lightning.clients.optim import configured_optimizer
from fl_lightning.clients.segmentation_metrics import (
    pixel_confusion,
    segmentation_metrics,
    soft_dice_from_sums,
    soft_dice_loss,
    soft_dice_sums,
)
from fl_lightning.clients.surface_metrics import (
    SURFACE_TOLERANCE,
    surface_metrics_from_sums,
    surface_metrics_per_image,
    surface_sums,
)
from fl_lightning.models.net_check import DUMMY_BATCH, check_net_shapes
from fl_lightning.models.segmenters import build_segmenter
from fl_lightning.models.unet import SegNormKind


class SegmentationClient(ClientModule):
    """A client that trains a segmentation network with cross-entropy + soft Dice (foreground classes).

    Batches are ``(images (N, C, H, W), masks (N, H, W) int64)`` with class 0 the background.
    ``evaluate`` reports, over all pixels of the test set: ``dice`` (mean Dice of the foreground
    classes; the primary metric), ``dice_with_background`` (mean over all classes, background
    included), ``miou`` (torchmetrics' macro Jaccard index, background included, classes absent from
    targets and predictions left out), ``acc`` (pixel accuracy) and ``loss`` (CE + soft Dice); and per image
    and foreground class, averaged over the images where defined and then over the classes: ``hd95`` (95th-percentile
    Hausdorff distance in pixels, lower is better) and ``surface_dice`` (normalised surface distance at tolerance
    ``surface_tolerance``); definitions and empty-mask cases in :mod:`fl_lightning.clients.surface_metrics`.

    Args:
        num_classes: Classes including background (linked from the data).
        in_channels: Image channels (linked from the data).
        image_size: Input (height, width) (linked from the data).
        arch: ``unet`` (the small UNet) or ``smp_unet`` (segmentation-models-pytorch, random encoder weights).
        width: Channels of the UNet's first level (smp: of its last decoder block).
        depth: Down-sampling steps (smp: encoder depth, 3–5).
        norm: Normalisation of the small UNet: ``batch``, ``instance`` (no running statistics), ``group``, ``none``.
        encoder: Encoder of ``smp_unet``.
        dice_weight: Weight of the soft Dice term (0: cross-entropy only).
        optimizer: Local optimiser: ``adam``, ``adamw`` or ``sgd``.
        lr: Local learning rate.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 weight decay of the local optimiser.
        surface_tolerance: Tolerance τ of the evaluation's ``surface_dice``, in pixels: a boundary pixel within τ
            of the other mask's boundary counts as correct (default 1: one pixel of boundary jitter is tolerated).
        net: Any ``torch.nn.Module`` mapping (N, in_channels, H, W) images to (N, num_classes, H, W) logits, given in
            a config by ``class_path`` and ``init_args`` (e.g. ``monai.networks.nets.UNet`` or ``BasicUNet``); it
            replaces the built-in network, and ``arch``, ``width``, ``depth``, ``norm`` and ``encoder`` are then
            unused. It is checked before training by one forward pass of a dummy batch of the data's shape and
            refused, with the expected and the actual shapes, when it does not take ``in_channels`` channels or
            does not return ``num_classes`` channels at the input's size (docs: how-to "Medical networks by class
            path").

    """

    primary_metric = "dice"

    def __init__(
        self,
        num_classes: int = 5,
        in_channels: int = 1,
        image_size: tuple[int, int] = (32, 32),
        arch: Literal["unet", "smp_unet"] = "unet",
        width: int = 16,
        depth: int = 2,
        norm: SegNormKind = "batch",
        encoder: str = "resnet18",
        dice_weight: float = 1.0,
        optimizer: Literal["adam", "adamw", "sgd"] = "adam",
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        surface_tolerance: float = SURFACE_TOLERANCE,
        net: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"model.num_classes must be >= 2 (background + a class), got {num_classes}")
        if lr <= 0:
            raise ValueError(f"model.lr must be positive, got {lr}")
        if dice_weight < 0:
            raise ValueError(f"model.dice_weight must be >= 0, got {dice_weight}")
        if not 0 <= surface_tolerance < float("inf"):
            raise ValueError(f"model.surface_tolerance must be finite and >= 0, got {surface_tolerance}")
        # The net is a module, not a hyper-parameter: its weights are state, its class path is in config.yaml.
        self.save_hyperparameters(ignore=["net"])
        if net is None:
            self.net = build_segmenter(
                arch, in_channels, num_classes, tuple(image_size), width=width, depth=depth, norm=norm, encoder=encoder
            )
        else:
            h, w = (int(s) for s in image_size)
            meaning = f"(N, data.num_classes={num_classes}, H, W) logits at the input's size"
            check_net_shapes(net, in_channels, (h, w), (DUMMY_BATCH, num_classes, h, w), meaning)
            self.net = net

    def forward(self, x: Tensor) -> Tensor:
        """Logits, shape (N, num_classes, H, W)."""
        return self.net(self.input_norm(x))

    def training_loss(self, batch: Any) -> Tensor:
        """Pixel cross-entropy + ``dice_weight`` · soft Dice (foreground) of ``(x, mask)``, plus registered terms."""
        x, y = batch[0], batch[1]
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        if self.hparams.dice_weight:
            loss = loss + self.hparams.dice_weight * soft_dice_loss(logits, y)
        for term in self.loss_terms.values():
            loss = loss + term(x=x, y=y, logits=logits, features=None)
        return loss

    def evaluate(self, batches: Iterable[Any], device: torch.device) -> dict[str, float]:
        """Dice (foreground), Dice with background, mIoU, pixel accuracy, loss, HD95 and surface Dice over ``batches``.

        Counts (and the per-image HD95 and surface Dice sums) are accumulated on the device batch by batch (never
        all logits at once), so the metrics are exact whatever the batch size and memory stays at one batch.
        """
        parts = self.evaluation_parts(batches, device)
        return self.metrics_from_parts(parts) if parts else {}

    @torch.inference_mode()
    def evaluation_parts(self, batches: Iterable[Any], device: torch.device) -> dict[str, Tensor]:
        """Additive counts of one test set (pixel confusion, mIoU confusion, soft-Dice sums, CE sum, pixels).

        Also, per foreground class, the sums over the test images of HD95 and surface Dice and the number of images
        where they are defined (``hd95_sum``, ``surface_dice_sum``, ``surface_images``): HD95 itself does not add
        up over test sets, these do, so the pooled HD95 is the mean over all pooled images, as on one test set.
        Counts of several test sets add up to the counts of their union exactly (integers; the float sums
        to rounding), so pooled metrics need no prediction to leave a client.
        """
        was_training = self.training
        self.eval()
        num_classes = self.hparams.num_classes
        confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
        # sync_on_compute=False: the counts are this test set's; under torch.distributed (clients sharded over
        # ranks) torchmetrics would otherwise wait for the other ranks in a collective they never join.
        jaccard = MulticlassJaccardIndex(num_classes, average="macro", validate_args=False, sync_on_compute=False)
        jaccard = jaccard.to(device)
        inter = torch.zeros(num_classes, device=device)
        denom = torch.zeros(num_classes, device=device)
        ce_sum, pixels = torch.zeros((), dtype=torch.float64, device=device), 0
        surface = {
            "hd95_sum": torch.zeros(num_classes - 1, dtype=torch.float64, device=device),
            "surface_dice_sum": torch.zeros(num_classes - 1, dtype=torch.float64, device=device),
            "surface_images": torch.zeros(num_classes - 1, dtype=torch.int64, device=device),
        }
        for batch in batches:
            x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            logits = self(x).float()
            preds = logits.argmax(1)
            confusion += pixel_confusion(preds, y, num_classes)
            jaccard.update(preds, y)
            i, d = soft_dice_sums(logits, y)
            inter, denom = inter + i, denom + d
            ce_sum += F.cross_entropy(logits, y, reduction="sum").double()
            per_image = surface_metrics_per_image(preds, y, num_classes, self.hparams.surface_tolerance)
            for k, v in surface_sums(*per_image).items():
                surface[k] += v
            pixels += y.numel()
        self.train(was_training)
        if not pixels:
            return {}
        return {
            "confusion": confusion.cpu(),
            "jaccard_confmat": jaccard.confmat.cpu(),
            "inter": inter.cpu(),
            "denom": denom.cpu(),
            "ce_sum": ce_sum.cpu(),
            "pixels": torch.tensor(pixels),
            **{k: v.cpu() for k, v in surface.items()},
        }

    pooled_parts_are_predictions = False  # additive counts: pooled metrics never need a prediction

    @staticmethod
    def merge_parts(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """Several test sets' counts as one (sums)."""
        merged = {}
        for k in parts[0]:
            total = parts[0][k]
            for p in parts[1:]:
                total = total + p[k]
            merged[k] = total
        return merged

    def metrics_from_parts(self, parts: dict[str, Tensor]) -> dict[str, float]:
        """The metrics of :meth:`evaluate` from (merged) counts."""
        jaccard = MulticlassJaccardIndex(
            self.hparams.num_classes, average="macro", validate_args=False, sync_on_compute=False
        )
        jaccard.confmat = parts["jaccard_confmat"].clone()
        loss = float(parts["ce_sum"]) / int(parts["pixels"])
        if self.hparams.dice_weight:
            loss += self.hparams.dice_weight * float(soft_dice_from_sums(parts["inter"], parts["denom"]))
        surface = surface_metrics_from_sums(parts["hd95_sum"], parts["surface_dice_sum"], parts["surface_images"])
        return {
            **segmentation_metrics(parts["confusion"]),
            "miou": float(_compute_without_update(jaccard)),
            "loss": loss,
            **surface,
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """A fresh local optimiser for each client fit, learning rate ``lr · lr_factor``.

        Adam 1e-3 by default; HarmoFL's paper uses Adam.
        """
        return configured_optimizer(self)


def _compute_without_update(metric: Any) -> Tensor:
    """``metric.compute()`` on states set from merged counts, without torchmetrics' "update() never ran" warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method", category=UserWarning)
        return metric.compute()
