"""Client LightningModules: one class per task."""

from fl_lightning.clients.base import ClientModule
from fl_lightning.clients.classification import ClassificationClient

__all__ = ["ClassificationClient", "ClientModule"]
