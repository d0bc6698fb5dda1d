"""FedBABU: only the body is trained and averaged; the head stays frozen at its shared initialisation."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L
from typing_extensions import override

from callbacks.head_body.heads import head_keys, head_modules
from fl_lightning.callback import FederatedCallback

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, ModelGroup, RuntimeView, ServerView
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Reply


class FedBABU(FederatedCallback):
    """FedBABU (Oh, Kim, Yun, ICLR 2022): the head is frozen at its (shared) initialisation during all rounds.

    **Client half.** During each local fit the head's parameters have ``requires_grad`` off (no gradient, no step;
    the flags are restored after the fit), so only the body learns; the upload holds the body only (the head is the
    initial one on every client).

    **Server half.** The body is the weighted mean of the bodies, the head stays the initial one, bit for bit.
    Personalisation comes at the end: add ``callbacks.LocalFineTuning(epochs=k)``, which fine-tunes each client's
    whole model (the other callbacks, this one included, are detached while it fine-tunes) and reports it as the
    model ``finetuned``. The head is found as :class:`~callbacks.FedPer` finds it.

    Args:
        head: Module names of the head (None: found).
    """

    def __init__(self, head: list[str] | None = None) -> None:
        super().__init__()
        self.head = None if head is None else list(head)
        self._head_keys: set[str] = set()
        self._frozen: list = []

    # ------------------------------------------------------------------ server half
    @override
    def on_aggregate(
        self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        return {**previous, **averaged}  # the uploads hold the body; the head is the initial one

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        self._head_keys = head_keys(runtime.module, self.head, "FedBABU")

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        prefixes = tuple(n + "." for n in head_modules(pl_module, self.head, "FedBABU"))
        self._frozen = [p for n, p in pl_module.named_parameters() if n.startswith(prefixes) and p.requires_grad]
        for p in self._frozen:
            p.requires_grad_(False)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []

    @override
    def on_upload(self, ctx: ClientContext, reply: Reply) -> None:
        reply.state = {k: v for k, v in reply.state.items() if k not in self._head_keys}
