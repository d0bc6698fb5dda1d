"""FedBABU: only the body is trained and averaged; the head stays frozen at its shared initialisation."""

from __future__ import annotations

import lightning as L
from typing_extensions import override

from callbacks.head_body.fedper import FedPer
from callbacks.head_body.heads import split_parameters


class FedBABU(FedPer):
    """FedBABU (Oh, Kim, Yun, ICLR 2022): the head is frozen at its (shared) initialisation during all rounds.

    **Client half.** During each local fit the head's parameters have ``requires_grad`` off (no gradient, no step;
    the flags are restored after the fit), so only the body learns; the upload holds the body only (the head is the
    initial one on every client: it is withheld as FedPer's, but not private).

    **Server half.** The body is the weighted mean of the bodies, the head stays the initial one, bit for bit.
    Personalisation comes at the end: add ``callbacks.LocalFineTuning(epochs=k)``, which fine-tunes each client's
    whole model (the other callbacks, this one included, are detached while it fine-tunes) and reports it as the
    model ``finetuned``. The head is found as :class:`~callbacks.FedPer` finds it.

    Args:
        head: Module names of the head (None: found).
    """

    keeps_private = False  # the withheld head is the shared initial one, the same on every client

    def __init__(self, head: list[str] | None = None) -> None:
        super().__init__(head=head)
        self._frozen: list = []

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        head, _ = split_parameters(pl_module, self.head, "FedBABU")
        self._frozen = [p for p in head if p.requires_grad]
        for p in self._frozen:
            p.requires_grad_(False)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []
