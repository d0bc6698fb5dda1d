"""fl_lightning: federated learning on heterogeneous data with one shared Lightning Trainer.

The names below are imported on first use (PEP 562), so importing a light submodule (``fl_lightning.protocol``,
the Flower engine's apps) does not import Lightning: a Flower simulation's driver starts Ray meanwhile.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fl_lightning import lean_imports

# Before anything imports Lightning: its import of torchmetrics then skips scipy.signal (see lean_imports.py).
lean_imports.install()

_WHERE = {
    "ClassificationClient": "fl_lightning.clients",
    "ClientModule": "fl_lightning.clients",
    "Federation": "fl_lightning.federation",
    "FederationConfig": "fl_lightning.config",
    "ModelGroup": "fl_lightning.state",
    "Reply": "fl_lightning.protocol",
    "Task": "fl_lightning.protocol",
}
__all__ = ["ClassificationClient", "ClientModule", "Federation", "FederationConfig", "ModelGroup", "Reply", "Task"]

if TYPE_CHECKING:
    from fl_lightning.clients import ClassificationClient, ClientModule
    from fl_lightning.config import FederationConfig
    from fl_lightning.federation import Federation
    from fl_lightning.protocol import Reply, Task
    from fl_lightning.state import ModelGroup


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'fl_lightning' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
