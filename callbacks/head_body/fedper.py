"""FedPer: the body is shared and averaged, the head stays on each client (and never leaves it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L
from typing_extensions import override

from callbacks.head_body.heads import head_keys
from fl_lightning.callback import FederatedCallback

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, ModelGroup, RuntimeView, ServerView
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Reply


class FedPer(FederatedCallback):
    """FedPer (Arivazhagan et al., 2019): a shared body w_b averaged as in FedAvg, a private head v_i per client.

    **Client half.** A client trains its whole model: the received body with its own head (the initial head before
    its first round); it keeps the head (its private state) and uploads only the body: the head's weights never
    leave the site.

    **Server half.** The body is the weighted mean of the uploaded bodies; the global model's head stays the
    initial one, so the ``global`` evaluation scores the shared body with an untrained head and the ``personal``
    one each client's body and head. Which layers are the head: ``head`` (module names, e.g.
    ``[net.classifier]``), else the last ``nn.Linear`` or convolution (:func:`~callbacks.head_body.heads.head_modules`).

    The variants in this folder change what is withheld (:meth:`withheld_keys`) and whether it is each client's
    own (``keeps_private``; FedBABU's withheld head is the shared initial one).

    Args:
        head: Module names of the head (None: found).
    """

    keeps_private = True  # the withheld part is each client's own (its private state)

    def __init__(self, head: list[str] | None = None) -> None:
        super().__init__()
        self.head = None if head is None else list(head)
        self._withheld: set[str] = set()

    def withheld_keys(self, module: L.LightningModule) -> set[str]:
        """The state keys that are never uploaded: the head's."""
        return head_keys(module, self.head, type(self).__name__)

    @override
    def private_keys(self, module: L.LightningModule) -> set[str]:
        return self.withheld_keys(module) if self.keeps_private else set()

    @override
    def uploaded_keys(self, module: L.LightningModule, keys: set[str]) -> set[str]:
        return keys - self.withheld_keys(module)

    # ------------------------------------------------------------------ server half
    @override
    def on_aggregate(
        self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        # The uploads hold the shared part only: the global model keeps its own copy of the private part.
        return {**previous, **averaged}

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        self._withheld = self.withheld_keys(runtime.module)

    @override
    def on_upload(self, ctx: ClientContext, reply: Reply) -> None:
        reply.state = {k: v for k, v in reply.state.items() if k not in self._withheld}
