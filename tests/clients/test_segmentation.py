"""Segmentation client: metrics against a hand example, the soft Dice loss, networks and a few training steps."""

import math

import pytest
import torch
from torch import nn

from fl_lightning.clients import SegmentationClient
from fl_lightning.clients.segmentation_metrics import (
    dice_per_class,
    pixel_confusion,
    segmentation_metrics,
    soft_dice_loss,
)
from fl_lightning.models.unet import UNet

# A hand example with 4 classes (0 = background) and one 2x4 image:
#   target  0 0 1 1      prediction  0 1 1 1
#           0 2 2 0                  0 2 0 0
# class 0: TP 3 (pixels (0,0) (1,0) (1,3)), FP 1 ((1,2) predicted 0, true 2), FN 1 ((0,1) true 0 predicted 1)
#          -> Dice 6/8 = 0.75,  IoU 3/5 = 0.6
# class 1: TP 2, FP 1, FN 0 -> Dice 4/5 = 0.8,  IoU 2/3
# class 2: TP 1, FP 0, FN 1 -> Dice 2/3,        IoU 1/2
# class 3: absent from target and prediction -> undefined, left out of every mean
TARGET = torch.tensor([[[0, 0, 1, 1], [0, 2, 2, 0]]])
PRED = torch.tensor([[[0, 1, 1, 1], [0, 2, 0, 0]]])
DICE_FG = (0.8 + 2 / 3) / 2
DICE_ALL = (0.75 + 0.8 + 2 / 3) / 3
MIOU = (0.6 + 2 / 3 + 0.5) / 3
ACC = 6 / 8
PREDICTED_FOREGROUND = 4 / 8  # PRED's non-zero pixels


def test_confusion_and_dice_by_hand():
    cm = pixel_confusion(PRED, TARGET, 4)
    assert cm.tolist() == [[3, 1, 0, 0], [0, 2, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]]
    dice = dice_per_class(cm)
    torch.testing.assert_close(dice[:3], torch.tensor([0.75, 0.8, 2 / 3], dtype=torch.float64))
    assert math.isnan(dice[3])
    metrics = segmentation_metrics(cm)
    assert metrics["dice"] == pytest.approx(DICE_FG)
    assert metrics["dice_with_background"] == pytest.approx(DICE_ALL)
    assert metrics["acc"] == pytest.approx(ACC)
    assert metrics["predicted_foreground"] == pytest.approx(PREDICTED_FOREGROUND)


class FixedLogits(nn.Module):
    """Returns one-hot logits of the stored prediction for the i-th image (the input is its index)."""

    def __init__(self, preds, num_classes):
        super().__init__()
        self.register_buffer("logits", 5.0 * nn.functional.one_hot(preds, num_classes).permute(0, 3, 1, 2).float())

    def forward(self, x):
        return self.logits[x[:, 0, 0, 0].long()]


def client_with_predictions(preds, num_classes=4):
    client = SegmentationClient(num_classes=num_classes, image_size=(2, 4), depth=1, width=2)
    client.net = FixedLogits(preds, num_classes)
    return client


def test_evaluate_against_the_hand_example_and_independent_of_batching():
    # Two copies of the example: dataset-level counts double, every ratio stays the same.
    preds, target = PRED.repeat(2, 1, 1), TARGET.repeat(2, 1, 1)
    client = client_with_predictions(preds)
    index = torch.arange(2.0).view(2, 1, 1, 1).expand(2, 1, 2, 4)
    whole = client.evaluate([(index, target)], torch.device("cpu"))
    split = client.evaluate([(index[:1], target[:1]), (index[1:], target[1:])], torch.device("cpu"))
    assert whole["dice"] == pytest.approx(DICE_FG)
    assert whole["dice_with_background"] == pytest.approx(DICE_ALL)
    assert whole["miou"] == pytest.approx(MIOU)
    assert whole["acc"] == pytest.approx(ACC)
    assert whole["predicted_foreground"] == pytest.approx(PREDICTED_FOREGROUND)
    assert whole.keys() == {
        "dice", "dice_with_background", "miou", "acc", "predicted_foreground", "loss", "hd95", "surface_dice"
    }  # fmt: skip
    for k in whole:
        assert split[k] == pytest.approx(whole[k])


def test_soft_dice_loss_by_hand():
    # Two classes, one 1x3 image; p(class 1) = 0.9, 0.2, 0.4 and target [1, 0, 0], smoothing 1.
    p1 = torch.tensor([0.9, 0.2, 0.4])
    logits = torch.stack([torch.log(1 - p1), torch.log(p1)]).view(1, 2, 1, 3)
    target = torch.tensor([[[1, 0, 0]]])
    # class 1: Σpg = 0.9, Σp = 1.5, Σg = 1 -> (1.8 + 1) / (2.5 + 1) = 0.8
    # class 0: Σpg = 1.4, Σp = 1.5, Σg = 2 -> (2.8 + 1) / (3.5 + 1) = 3.8 / 4.5
    assert float(soft_dice_loss(logits, target)) == pytest.approx(1 - 0.8)
    assert float(soft_dice_loss(logits, target, include_background=True)) == pytest.approx(1 - (0.8 + 3.8 / 4.5) / 2)
    perfect = 50.0 * nn.functional.one_hot(target, 2).permute(0, 3, 1, 2).float()
    assert float(soft_dice_loss(perfect, target, smooth=0.0)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("norm", ["batch", "instance"])
def test_unet_shapes_and_norm_layers(norm):
    net = UNet(3, 5, (16, 24), width=4, depth=2, norm=norm)
    assert net(torch.rand(2, 3, 16, 24)).shape == (2, 5, 16, 24)
    kind = nn.BatchNorm2d if norm == "batch" else nn.InstanceNorm2d
    norms = [m for m in net.modules() if isinstance(m, (nn.BatchNorm2d, nn.InstanceNorm2d))]
    assert norms and all(isinstance(m, kind) for m in norms)
    if norm == "instance":  # per-image statistics at test time too
        assert all(not m.track_running_stats for m in norms)
    with pytest.raises(ValueError, match="divisible by 4"):
        UNet(1, 5, (10, 12), depth=2)


def test_smp_unet_without_pretrained_weights():
    client = SegmentationClient(num_classes=3, in_channels=1, image_size=(16, 16), arch="smp_unet", depth=3, width=4)
    assert client(torch.rand(2, 1, 16, 16)).shape == (2, 3, 16, 16)
    with pytest.raises(ValueError, match="depth"):
        SegmentationClient(arch="smp_unet", depth=2)


def test_a_few_adam_steps_fit_a_fixed_batch():
    torch.manual_seed(0)
    x = torch.rand(4, 1, 8, 8)
    y = (x[:, 0] > 0.5).long() + (x[:, 0] > 0.8).long()  # 3 classes from intensity
    client = SegmentationClient(num_classes=3, image_size=(8, 8), width=4, depth=1, lr=1e-2)
    opt = client.configure_optimizers()
    first = client.training_loss((x, y)).item()
    for _ in range(30):
        opt.zero_grad()
        client.training_loss((x, y)).backward()
        opt.step()
    assert client.training_loss((x, y)).item() < 0.5 * first
    assert client.primary_metric == "dice"
