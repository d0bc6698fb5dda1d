"""fl_lightning: federated learning on heterogeneous data with one shared Lightning Trainer.

The names below are imported on first use (PEP 562), so importing a light submodule (``fl_lightning.wire.protocol``,
the Flower engine's apps) does not import Lightning: a Flower simulation's driver starts Ray meanwhile.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fl_lightning.startup import lean_imports, moved

# Before anything imports Lightning: its import of torchmetrics then skips scipy.signal (see lean_imports.py).
lean_imports.install()
moved.install()  # module paths from before the layout step (saved configs name classes by them)

_WHERE = {
    "ClassificationClient": "fl_lightning.clients",
    "ClientModule": "fl_lightning.clients",
    "Federation": "fl_lightning.server.federation",
    "FederationConfig": "fl_lightning.config",
    "ModelGroup": "fl_lightning.callback",
    "local_federation": "fl_lightning.engines.local",
    "Reply": "fl_lightning.wire.protocol",
    "Task": "fl_lightning.wire.protocol",
}
__all__ = [
    "ClassificationClient",
    "ClientModule",
    "Federation",
    "FederationConfig",
    "ModelGroup",
    "Reply",
    "Task",
    "local_federation",
]

if TYPE_CHECKING:
    from fl_lightning.callback import ModelGroup
    from fl_lightning.clients import ClassificationClient, ClientModule
    from fl_lightning.config import FederationConfig
    from fl_lightning.engines.local import local_federation
    from fl_lightning.server.federation import Federation
    from fl_lightning.wire.protocol import Reply, Task


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'fl_lightning' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
