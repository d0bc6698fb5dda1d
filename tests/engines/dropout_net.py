"""A network with a random layer, given to runs by class path (``--model.net``) to test exact continuation."""

from __future__ import annotations

from torch import nn

from fl_lightning.models.cnn import SmallCNN


class DropoutCNN(nn.Module):
    """The GroupNorm SmallCNN of the tiny digits runs (1 channel, 10 classes, 8 × 8) with dropout before its head.

    Dropout draws a mask from torch's global generator at every training step: a run whose random state is not
    carried exactly across a resume or a change of rank count ends with other weights.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8, width: int = 4) -> None:
        super().__init__()
        self.cnn = SmallCNN(in_channels, num_classes, (image_size, image_size), width=width, norm="group")
        self.cnn.classifier = nn.Sequential(nn.Dropout(0.5), self.cnn.classifier)

    def forward(self, x):
        return self.cnn(x)
