"""fl_lightning: federated learning on heterogeneous data with one shared Lightning Trainer."""

from fl_lightning.clients import ClassificationClient, ClientModule
from fl_lightning.config import FederationConfig
from fl_lightning.federation import Federation
from fl_lightning.protocol import Reply, Task
from fl_lightning.state import ModelGroup

__all__ = ["ClassificationClient", "ClientModule", "Federation", "FederationConfig", "ModelGroup", "Reply", "Task"]
