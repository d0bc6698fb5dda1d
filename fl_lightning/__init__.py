"""fl_lightning: federated learning on heterogeneous data with one shared Lightning Trainer."""

from fl_lightning.clients import ClassificationClient, ClientModule
from fl_lightning.config import FederationConfig
from fl_lightning.federation import Federation
from fl_lightning.state import ClientUpdate, ModelGroup

__all__ = ["ClassificationClient", "ClientModule", "ClientUpdate", "Federation", "FederationConfig", "ModelGroup"]
