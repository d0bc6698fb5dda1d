"""FedRep: FedPer's split, trained in two phases each fit — the private head first, then the shared body."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L
from typing_extensions import override

from callbacks.head_body.fedper import FedPer
from callbacks.head_body.heads import split_parameters

if TYPE_CHECKING:
    from fl_lightning.callback import ServerView
    from fl_lightning.wire.protocol import Task


class FedRep(FedPer):
    """FedRep (Collins et al., ICML 2021): in each fit the private head first, then the shared body.

    Each local fit trains the head for ``head_epochs`` epochs with the body frozen, then the body for
    ``federation.local_epochs`` epochs with the head frozen. The head stays on the client, the body is uploaded and
    averaged (as :class:`~callbacks.FedPer`). A fit task asks for ``head_epochs + local_epochs`` epochs; the phase
    of each epoch is set in ``on_train_epoch_start`` by turning the parameters' ``requires_grad`` off and on, so a
    frozen part gets no gradient and no optimiser step (its running statistics, e.g. BatchNorm's, are still updated
    by the forward passes). Needs ``local_epochs`` (not ``local_steps``). With ``head_epochs = 0`` the head is never
    trained: every client keeps the initial head and only the body learns.

    Args:
        head_epochs: τ_h, the head's epochs before the body's (the paper's 10 for its small heads).
        head: Module names of the head (None: found as FedPer finds it).
    """

    def __init__(self, head_epochs: int = 1, head: list[str] | None = None) -> None:
        super().__init__(head=head)
        if head_epochs < 0:
            raise ValueError(f"FedRep head_epochs must be >= 0, got {head_epochs}")
        self.head_epochs = head_epochs
        self._phases: tuple[int, list, list, dict] | None = None

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: ServerView) -> None:
        if server.config.local_steps is not None:
            raise ValueError(
                "FedRep trains its head and its body in epochs: set federation.local_epochs (the body's) and "
                f"FedRep's head_epochs, not federation.local_steps={server.config.local_steps}"
            )

    @override
    def configure_task(self, server: ServerView, task: Task) -> None:
        task.epochs = task.epochs + self.head_epochs  # the head's epochs come first

    # ------------------------------------------------------------------ client half
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        head, body = split_parameters(pl_module, self.head, "FedRep")
        flags = {id(p): p.requires_grad for p in [*head, *body]}
        self._phases = (trainer.current_epoch, head, body, flags)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        start, head, body, flags = self._phases
        head_phase = trainer.current_epoch - start < self.head_epochs
        for p in head:
            p.requires_grad_(flags[id(p)] and head_phase)
        for p in body:
            p.requires_grad_(flags[id(p)] and not head_phase)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _, head, body, flags = self._phases
        for p in [*head, *body]:
            p.requires_grad_(flags[id(p)])
        self._phases = None
