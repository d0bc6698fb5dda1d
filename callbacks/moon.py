"""MOON: model-contrastive learning pulls local representations towards the global model's."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor, nn
from typing_extensions import override

from callbacks.base import FederatedCallback
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.moon import moon_contrastive_loss

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, RuntimeView
    from fl_lightning.wire.protocol import Reply


class Moon(FederatedCallback):
    """Adds μ·ℓ_con to each client's loss (Li, He, Song, 2021); the server does FedAvg.

    A client-only method: it adds nothing to the messages. Contract: the client module's ``net`` exposes
    ``features`` (the representation z; in SmallCNN and MLP it ends with a hidden linear layer, which plays
    the part of MOON's projection head) and ``classifier``, and the module supports ``loss_terms`` (every
    ClientModule does). The global and previous models are frozen copies used in eval mode (their BatchNorm
    statistics are not disturbed) and see the input exactly as the local model saw it (after the module's
    ``input_norm``, never a second pass through it). A client training for the first time uses the global
    model as its previous model, which makes ℓ_con constant (log 2) with zero gradient. Each client's
    previous model is its private state (``ctx.state["previous"]``, on the CPU, in its runtime).

    Args:
        mu: Weight μ of the contrastive term; 0 gives FedAvg.
        temperature: Temperature T of the cosine similarities.

    """

    def __init__(self, mu: float = 5.0, temperature: float = 0.5) -> None:
        super().__init__()
        if mu < 0 or temperature <= 0:
            raise ValueError(f"Moon needs mu >= 0 and temperature > 0, got mu={mu}, temperature={temperature}")
        self.mu, self.temperature = mu, temperature
        self._frozen: tuple[nn.Module, nn.Module] | None = None

    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        net = getattr(runtime.module, "net", None)
        if not (isinstance(net, nn.Module) and hasattr(net, "features") and hasattr(net, "classifier")):
            raise PreconditionError(
                "Moon needs the client module's `net` to expose `features` (the representation) and "
                f"`classifier` modules; {type(net).__name__} does not (use model.arch=cnn or mlp)"
            )
        if not hasattr(runtime.module, "loss_terms"):
            raise PreconditionError("Moon needs a ClientModule with `loss_terms`")

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Copies made here, after Lightning moved the module to its device; the weights are the received global ones.
        global_net = _frozen_copy(pl_module.net)
        previous_net = _frozen_copy(pl_module.net)
        previous = self.fit_context.state.get("previous")
        if previous is not None:
            previous_net.load_state_dict(previous)
        self._frozen = (global_net, previous_net)
        pl_module.loss_terms["moon"] = self._term

    def _term(self, features: Tensor, x_normalized: Tensor, **_: Any) -> Tensor:
        global_net, previous_net = self._frozen
        with torch.no_grad():
            z_global, z_previous = global_net.features(x_normalized), previous_net.features(x_normalized)
        return self.mu * moon_contrastive_loss(features, z_global, z_previous, self.temperature)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.loss_terms.pop("moon", None)
        self._frozen = None

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        ctx.state["previous"] = {k.removeprefix("net."): v for k, v in reply.state.items() if k.startswith("net.")}


def _frozen_copy(net: nn.Module) -> nn.Module:
    frozen = copy.deepcopy(net).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    return frozen
