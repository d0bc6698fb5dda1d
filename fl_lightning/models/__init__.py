"""Networks for the client modules."""

from fl_lightning.models.cnn import SmallCNN
from fl_lightning.models.registry import build_classifier

__all__ = ["SmallCNN", "build_classifier"]
