"""Client LightningModules: one class per task."""

from fl_lightning.clients.base import ClientModule
from fl_lightning.clients.classification import ClassificationClient
from fl_lightning.clients.segmentation import SegmentationClient
from fl_lightning.clients.survival import SurvivalClient
from fl_lightning.clients.tabular import TabularClient

__all__ = ["SurvivalClient", "ClassificationClient", "ClientModule", "SegmentationClient", "TabularClient"]
