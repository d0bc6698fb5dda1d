"""Networks for the client modules."""

from fl_lightning.models.amplitude_norm import AmplitudeNorm
from fl_lightning.models.cnn import SmallCNN
from fl_lightning.models.registry import build_classifier
from fl_lightning.models.segmenters import build_segmenter
from fl_lightning.models.unet import UNet

__all__ = ["AmplitudeNorm", "SmallCNN", "UNet", "build_classifier", "build_segmenter"]
