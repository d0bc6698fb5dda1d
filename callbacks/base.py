"""The base class of every federation mechanism: a Lightning callback with round hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L

if TYPE_CHECKING:  # imported for type hints only; the Federation imports callbacks, not the reverse
    from torch.utils.data import DataLoader

    from fl_lightning.federation import ClientUpdate, Federation, ModelGroup
    from fl_lightning.ops.state import StateDict


class FederatedCallback(L.Callback):
    """A Lightning callback that also takes part in the federated round.

    The Federation calls the round hooks below in this order each round; the usual Lightning hooks
    (``on_train_start``, ``on_before_optimizer_step``, …) run inside each client's local fit as
    for any callback. Callbacks must not depend on each other's order.

    Once: ``prepare_module`` → ``private_keys`` → ``on_federation_start``. Each round:
    ``on_round_start`` → per client: ``on_client_start`` → local fit → ``on_client_end`` →
    per group: ``on_aggregate`` → evaluation (with ``extra_evaluation``) → ``on_round_end``.

    Raise :class:`fl_lightning.errors.PreconditionError` when the method cannot work with the
    configured model or optimiser: the run stops with that message instead of dropping clients.

    State that must survive a checkpoint goes in ``state_dict`` (plain tensors, numbers, strings,
    dicts and lists), keyed by client id where it is per client.
    """

    def prepare_module(self, federation: Federation, module: L.LightningModule) -> None:
        """Once, before the initial global state is taken: add layers or buffers the method needs.

        Layers belong to the model (so they are aggregated, checkpointed and moved with it); a
        callback that needs one (e.g. an amplitude-normalisation layer) inserts it here.
        """

    def private_keys(self, module: L.LightningModule) -> set[str]:
        """State-dict keys of ``module`` that stay on each client and are never averaged."""
        return set()

    def on_federation_start(self, federation: Federation) -> None:
        """Once, before the first round (and again after a resume); check preconditions here."""

    def on_round_start(self, federation: Federation, round_idx: int, selected: list[str]) -> None:
        """Before any client of round ``round_idx`` trains."""

    def on_client_start(self, federation: Federation, client_id: str, module: L.LightningModule) -> None:
        """After the client's weights are loaded into ``module``, before its local fit."""

    def wrap_train_loader(self, federation: Federation, client_id: str, loader: DataLoader) -> DataLoader:
        """Return the loader the client trains on this round (e.g. real batches joined by replay samples)."""
        return loader

    def on_client_end(
        self, federation: Federation, client_id: str, module: L.LightningModule, update: ClientUpdate
    ) -> None:
        """After the local fit; ``update`` is what the client uploads and may be changed in place."""

    def on_aggregate(
        self, federation: Federation, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        """Server side: return the group's new global state given the previous one and the average."""
        return averaged

    def moves_models(self) -> bool:
        """Peer-to-peer only: whether models travel to the successor (False keeps them on their node)."""
        return True

    def on_pass_on(self, federation: Federation, successor: dict[str, str]) -> None:
        """Peer-to-peer only: the round's cycle (node → successor), to pass what the callback holds."""

    def on_round_end(self, federation: Federation, round_idx: int, metrics: dict[str, Any]) -> None:
        """After aggregation, evaluation and recording of round ``round_idx``.

        ``metrics`` is the round's row of ``rounds.csv``; entries a callback adds to it are written too.
        """

    def summary_entries(self, federation: Federation) -> dict[str, Any]:
        """Entries the callback adds to ``summary.json`` (e.g. a clustering's quality)."""
        return {}

    def extra_evaluation(self, federation: Federation) -> dict[str, dict[str, dict[str, float]]]:
        """Models the callback evaluates itself, merged into the evaluation next to ``global``.

        Returns:
            ``{model_name: {client_id: metrics}}`` (e.g. cluster models with each test image routed to
            one of them); each model is summarised with mean/std/worst like ``global``.
        """
        return {}
