"""FedBN: normalisation layers stay local to each client."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import lightning as L
from torch import nn
from typing_extensions import override

from callbacks.base import FederatedCallback
from fl_lightning.models.layer_kinds import BATCH_NORMS, INSTANCE_NORMS

if TYPE_CHECKING:
    from fl_lightning.callback import ServerView

NORM_TYPES: tuple[type[nn.Module], ...] = (*BATCH_NORMS, *INSTANCE_NORMS, nn.GroupNorm)


def norm_state_keys(module: nn.Module, norm_types: tuple[type[nn.Module], ...] = NORM_TYPES) -> set[str]:
    """State-dict keys (affine parameters and running statistics) of every normalisation layer.

    Layers are found by module type, never by attribute name, so a norm layer called ``foo``
    is found and a linear layer called ``bn`` is not.

    Args:
        module: The model.
        norm_types: Module classes that count as normalisation layers.

    """
    keys: set[str] = set()
    for name, sub in module.named_modules():
        if isinstance(sub, norm_types):
            prefix = f"{name}." if name else ""
            keys.update(prefix + k for k in sub.state_dict())
    return keys


class FedBN(FederatedCallback):
    """Averages everything except normalisation layers, which each client keeps and is evaluated with.

    The global model's own norm layers (used only to evaluate the "global" model and to
    initialise a client that has not trained yet) are the sample-weighted mean of the clients'.

    Args:
        include_layer_norm: Also keep ``nn.LayerNorm`` layers local (not part of FedBN's paper).

    """

    def __init__(self, include_layer_norm: bool = False) -> None:
        super().__init__()
        self.include_layer_norm = include_layer_norm

    @override
    def private_keys(self, module: L.LightningModule) -> set[str]:
        types = NORM_TYPES + ((nn.LayerNorm,) if self.include_layer_norm else ())
        return norm_state_keys(module, types)

    @override
    def on_federation_start(self, server: ServerView) -> None:
        if not self.private_keys(server.module):  # e.g. MONAI's UNet: InstanceNorm without weights or statistics
            warnings.warn(
                "FedBN found no normalisation layer with weights or running statistics in the model: every client "
                "keeps nothing of its own and the run is FedAvg (give the net affine or tracked norm layers, e.g. "
                "MONAI's norm='batch')",
                stacklevel=2,
            )
