"""The contract between the core and a method: what a callback's two halves are given, and nothing more.

A method is a :class:`FederatedCallback`. Its server half is given a :class:`ServerView` (what it may read and ask
of the server), its client half a :class:`RuntimeView` once and a :class:`ClientContext` per task; both halves
exchange only the messages of :mod:`fl_lightning.wire.protocol`. Nothing here imports the server or the runtime:
they satisfy these interfaces, and a method depends on this file, the messages and :mod:`fl_lightning.ops`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import lightning as L
from torch import Tensor

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

    from datamodules.base import FederatedDataModule
    from fl_lightning.config import FederationConfig
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Reply, Task
    from fl_lightning.wire.transport import Transport


@dataclass
class ModelGroup:
    """One global model and the clients that train it.

    FedAvg has one group; clustered methods (CFL, sample-clustered FL) hold several, and a client
    may belong to more than one.

    Attributes:
        name: Group name, used in metric keys and checkpoints.
        state: The group's global state dict (CPU tensors).
        members: Ids of the clients that train this group's model.
        subsets: Sample-level groups (sample-clustered FL): per member, the int64 indices of the
            training samples it trains this model on; its aggregation weight is the subset size
            n_{i,m}. ``None``: every member trains on all its samples.

    """

    name: str
    state: StateDict
    members: list[str]
    subsets: dict[str, Tensor] | None = None


class ServerView(Protocol):
    """What a callback's server half may use of the server (:class:`~fl_lightning.server.federation.Federation`).

    Attributes:
        config: The run's ``federation:`` settings.
        seed: The run's seed.
        round: Rounds completed so far (the running round's 0-based index during a round).
        module: The server's copy of the client module: the model's architecture and hyperparameters (its
            weights are the initial ones; the global states are in ``groups``).
        data: The clients' metadata: ids, training and test set sizes, batch size, image shape (a
            :class:`~fl_lightning.server.directory.ClientDirectory` when the server holds no data).
        groups: The model groups, in order.
        callbacks: Every federated callback of the run, in hook order.
        transport: What carries the tasks (its ``name`` and the capabilities an engine declares).
        run_path: The run directory (``None`` before the run opened it).
        device: Device of the server's Trainer.
        has_global_model: Whether a server-side global model exists (not in local-only or peer-to-peer runs).
        eval_split: The split of the evaluation running now (``val`` on evaluation rounds when the clients have
            a validation split, ``test`` otherwise and at the end): what ``extra_evaluation`` must score.
    """

    config: FederationConfig
    seed: int
    round: int
    module: L.LightningModule
    data: FederatedDataModule
    groups: list[ModelGroup]
    callbacks: list[FederatedCallback]
    transport: Transport
    eval_split: str

    @property
    def run_path(self) -> Path | None:
        """The run directory (``None`` before the run opened it)."""

    @property
    def device(self) -> torch.device:
        """Device of the Trainer."""

    @property
    def has_global_model(self) -> bool:
        """Whether a server-side global model exists."""

    def num_samples(self, client_id: str, group: ModelGroup | None = None) -> int:
        """Training samples of a client (n_{i,m} of its subset in a sample-level group)."""

    def group_of(self, client_id: str) -> ModelGroup:
        """The group whose global model serves ``client_id`` at evaluation."""

    def query(
        self,
        callback: FederatedCallback,
        name: str,
        client_ids: list[str],
        payloads: Any = None,
        group: str = "",
        state: StateDict | None = None,
        per_client: bool = False,
    ) -> dict[str, Any]:
        """Ask each client the callback's named query (its client half's ``answer_query``); ``{client: answer}``."""

    def split_group(self, group: ModelGroup, parts: list[list[str]]) -> list[ModelGroup]:
        """Replace ``group`` by one group per part of its clients; returns the new groups."""

    def split_samples(self, group: ModelGroup, assignments: dict[str, Tensor], n_parts: int) -> list[ModelGroup]:
        """Replace ``group`` by ``n_parts`` sample-level groups from each client's per-sample part ids."""


class RuntimeView(Protocol):
    """What a callback's client half may use of the runtime that hosts it, in ``on_runtime_start``.

    Attributes:
        config: The run's ``federation:`` settings (the same on every side).
        seed: The run's seed.
        module: The runtime's client module (one for every hosted client).
        trainer: The Trainer that fits every hosted client.
        data: The hosted clients' data.
        client_ids: The clients this runtime hosts.
        private_keys: State keys that stay on each client (never averaged).
        keep_optimizer_state: Whether each client's optimiser state is kept across rounds.
        workdir: This side's directory for large files (``None`` where a runtime has none).
        callbacks: Every federated callback's client half on this runtime, in hook order.
        device: Device of the Trainer.
        note: Prints a progress note (e.g. a GAN phase starting).
    """

    config: FederationConfig
    seed: int
    module: L.LightningModule
    trainer: L.Trainer
    data: FederatedDataModule
    client_ids: list[str]
    private_keys: set[str]
    keep_optimizer_state: bool
    workdir: Path | None
    callbacks: list[FederatedCallback]
    note: Callable[[str], None]

    @property
    def device(self) -> torch.device:
        """Device of the Trainer."""


def _no_hosted_states() -> dict[str, dict[str, Any]]:
    return {}


@dataclass
class ClientContext:
    """What a callback's client half sees of one task: never the server, and of the runtime only what is named here.

    Attributes:
        client_id: The client the task is for.
        round: 0-based index of the running round.
        group: The model group of the task.
        payload: This callback's payload of the task (``None`` if the server sent none).
        state: This callback's private state of this client: a dict the runtime keeps between rounds and
            saves in checkpoints (e.g. SCAFFOLD's c_i). Change it in place.
        received: The global state the task carried (``None`` if it carried none).
        task: The task itself.
        module: The runtime's client module (a fit has loaded the received and private state into it).
        data: The hosting runtime's data (a callback reads only ``client_id``'s).
        device: Device of the runtime's Trainer.
        config: The run's ``federation:`` settings.
        seed: The run's seed (the same on every side).
        private: The client's private state in the task's group (empty if it has none), as the runtime keeps it.
        private_keys: State keys that stay on each client.
        hosted_states: This callback's ``state`` of every client the runtime hosts, ``{client: state}`` (for a
            client half that works on all its clients at once, as Domain Isolation's selector does).
        fit_alone: ``fit_alone(loader, epochs)`` fits ``module`` for this client on ``loader`` with a fresh
            optimiser and every federated callback detached (a plain local fit, as LocalFineTuning's);
            returns the optimiser steps.
        personal: The client's whole personal model in the task's group, for a method that trains one beside the
            group's model (Ditto, MR-MTL, APFL's mixture); ``None`` until it has one. A client half that trains it
            sets a new state here in ``on_client_end``: the runtime keeps it per client and group, checkpoints it,
            evaluates it as the client's ``personal`` model and sends it as the client's own model to the
            cross-site evaluation. It never leaves the site otherwise.

    """

    client_id: str
    round: int
    group: str
    payload: Any
    state: dict[str, Any]
    received: StateDict | None
    task: Task
    module: L.LightningModule
    data: FederatedDataModule
    device: torch.device
    config: FederationConfig
    seed: int
    private: StateDict = field(default_factory=dict)
    private_keys: frozenset[str] | set[str] = frozenset()
    hosted_states: Callable[[], dict[str, dict[str, Any]]] = _no_hosted_states
    fit_alone: Callable[[DataLoader, int], int] | None = None
    personal: StateDict | None = None


class FederatedCallback(L.Callback):
    """A Lightning callback that takes part in the federated round, on both sides of the boundary.

    One method is one file with two halves that talk only through messages
    (:class:`~fl_lightning.wire.protocol.Task` / :class:`~fl_lightning.wire.protocol.Reply` payloads):

    **Server half** (called by the server, which it sees as a :class:`ServerView`):
    ``on_federation_start`` → each round ``on_round_start`` → per task ``configure_task`` (add a payload
    with :meth:`put_payload`, or set the task's budget) → per reply ``on_reply`` (read payloads with
    :meth:`get_payload`) → per group ``on_mean`` → ``on_aggregate`` → ``on_pass_on`` (peer-to-peer) → evaluation
    (``extra_evaluation``) → ``on_round_end``. ``state_dict``/``load_state_dict`` hold the server half's state.

    **Client half** (called by the client runtime, which ``on_runtime_start`` sees as a :class:`RuntimeView`):
    ``on_runtime_start`` once → per fit ``on_client_start`` → ``wrap_train_loader`` → the usual Lightning
    hooks during the local fit → ``on_client_end`` → ``on_upload``; named queries go to ``answer_query``. Each hook
    gets a :class:`ClientContext`: the client id, round, this callback's task payload, the received global state
    and the client's private state for this callback (``ctx.state``, a dict the runtime keeps and checkpoints per
    client). During a fit, Lightning's own hooks (``on_before_optimizer_step``, …) find the running fit's context in
    :attr:`fit_context`.

    Both sides: ``prepare_module`` (add layers) and ``private_keys`` are pure functions of the callback's
    settings and the module, called once on every side that holds a module.

    A callback that replaces the server step (the aggregation rule) sets ``server_step`` to a name; the
    Federation refuses two such callbacks unless their pair is in ``COMPOSABLE_SERVER_STEPS``.

    A client half whose object remembers between tasks what it learnt from its runtime's clients, outside
    ``ctx.state`` and reset in ``on_runtime_start`` (Domain Isolation's features and routing), sets
    ``runtime_bound``: one callback object then serves one runtime only. Otherwise a process hosting several
    Flower nodes (a Simulation Engine actor) builds the CLI once and lets each node's runtime share its
    module, data, Trainer and callbacks.

    Raise :class:`fl_lightning.errors.PreconditionError` when the method cannot work with the
    configured model or optimiser: the run stops with that message instead of dropping clients.
    """

    server_step: ClassVar[str | None] = None
    runtime_bound: ClassVar[bool] = False
    _fit_context: ClientContext | None = None

    @property
    def fit_context(self) -> ClientContext:
        """Client: the context of the running fit, for Lightning's hooks during it (set by the runtime).

        Raises:
            RuntimeError: Outside a fit (between ``on_client_start`` and ``on_upload``).
        """
        if self._fit_context is None:
            raise RuntimeError(f"{type(self).__name__}.fit_context is only set during a client's fit")
        return self._fit_context

    def bind_client(self, ctx: ClientContext | None) -> None:
        """Client: the runtime sets the running fit's context (``None`` after it); see :attr:`fit_context`."""
        self._fit_context = ctx

    # ------------------------------------------------------------------ both sides
    def prepare_module(self, module: L.LightningModule, data: Any) -> None:
        """Once per side, before the initial state is taken: add layers or buffers the method needs.

        Args:
            module: The client module (the server's template or a runtime's module).
            data: The datamodule's description (``in_channels``, ``image_size``, ``num_classes``).
        """

    def private_keys(self, module: L.LightningModule) -> set[str]:
        """State-dict keys of ``module`` that stay on each client and are never averaged."""
        return set()

    def uploaded_keys(self, module: L.LightningModule, keys: set[str]) -> set[str]:
        """The state entries a fit reply carries, of the ``keys`` the callbacks before this one leave in it.

        Override it in a callback whose ``on_upload`` takes entries out of the reply: the server refuses a reply
        that carries other entries than every callback says (:mod:`fl_lightning.server.reply_check`).
        """
        return keys

    def hides_updates(self) -> bool:
        """Whether this callback hides each client's update from the server (secure aggregation).

        The run's federated statistics are then summed securely too, unless ``federation.stats_secure`` says
        otherwise (:mod:`fl_lightning.server.secure_statistics`).
        """
        return False

    # ------------------------------------------------------------------ payload helpers
    def put_payload(self, message: Task | Reply, payload: Any) -> None:
        """Attach this callback's payload to a task (server half) or a reply (client half)."""
        message.payloads[self.state_key] = payload

    def get_payload(self, message: Task | Reply, default: Any = None) -> Any:
        """The payload of this callback in a task or reply (``default`` if there is none)."""
        return message.payloads.get(self.state_key, default)

    # ------------------------------------------------------------------ server half
    def on_federation_start(self, server: ServerView) -> None:
        """Server: once before the first round (and again after a resume); check preconditions here."""

    def on_round_start(self, server: ServerView, round_idx: int, selected: list[str]) -> None:
        """Server: before any task of round ``round_idx`` is sent."""

    def configure_task(self, server: ServerView, task: Task) -> None:
        """Server: before a ``fit`` task is sent; add a payload (:meth:`put_payload`) or set its budget."""

    def on_reply(self, server: ServerView, task: Task, reply: Reply, weight: float) -> None:
        """Server: a successful ``fit`` reply arrived, before it enters its group's mean with ``weight``.

        Replies are handled in the order of the round's selection, whatever order they arrived in.
        """

    def on_aggregate(
        self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        """Server: return the group's new global state given the previous one and the weighted average."""
        return averaged

    def on_mean(self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict) -> StateDict:
        """Server: the group's weighted mean of the uploads, before any callback's ``on_aggregate`` sees it.

        For a callback that changes what the uploads are rather than how they are combined (secure aggregation
        puts the unmasked sum here), so every ``on_aggregate`` (FedOpt, DP-FedAvg) sees the plain mean whatever
        the callbacks' order. Most methods use ``on_aggregate``.
        """
        return averaged

    def moves_models(self) -> bool:
        """Peer-to-peer only: whether models travel to the successor (False keeps them on their node)."""
        return True

    def on_pass_on(self, server: ServerView, round_idx: int, successor: dict[str, str]) -> None:
        """Server, peer-to-peer only: the round's cycle (node → successor); relay what the nodes pass on."""

    def on_round_end(self, server: ServerView, round_idx: int, metrics: dict[str, Any]) -> None:
        """Server: after aggregation, evaluation and recording; entries added to ``metrics`` are written too."""

    def extra_evaluation(self, server: ServerView) -> dict[str, dict[str, dict[str, float]]]:
        """Server: models the callback evaluates (through query tasks), as ``{model: {client: metrics}}``."""
        return {}

    def summary_entries(self, server: ServerView) -> dict[str, Any]:
        """Server: entries the callback adds to ``summary.json`` (e.g. a clustering's quality)."""
        return {}

    # ------------------------------------------------------------------ client half
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        """Client: once when a runtime starts (and after a resume); check the module and Trainer here."""

    def on_client_start(self, ctx: ClientContext, module: L.LightningModule) -> None:
        """Client: the received weights (and the client's private state) are loaded; before the local fit."""

    def wrap_train_loader(self, ctx: ClientContext, loader: DataLoader) -> DataLoader:
        """Client: the loader the client trains on this round (e.g. real batches joined by replay samples)."""
        return loader

    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        """Client: after the local fit; ``reply`` (state, counts) may be changed and given payloads."""

    def on_upload(self, ctx: ClientContext, reply: Reply) -> None:
        """Client: the last look at a fit reply before it leaves, after every callback's ``on_client_end``.

        For a callback that must transform the final upload whatever the callbacks' order (secure aggregation masks
        the update DP-FedAvg clipped and noised). Most methods use ``on_client_end``.
        """

    def answer_query(self, ctx: ClientContext, name: str, payload: Any) -> Any:
        """Client: answer the named query task; the return value is the reply's payload.

        Raises:
            KeyError: For a query name the callback does not know.
        """
        raise KeyError(f"{type(self).__name__} answers no query {name!r}")

    def client_state_dict(self) -> dict[str, Any]:
        """Client: state of the client half that is not per client (per-client state lives in ``ctx.state``)."""
        return {}

    def load_client_state_dict(self, state: dict[str, Any]) -> None:
        """Client: restore :meth:`client_state_dict`."""


# Pairs of server steps whose composition is defined (and tested). Everything else is refused.
COMPOSABLE_SERVER_STEPS: frozenset[frozenset[str]] = frozenset()


def check_composition(callbacks: list[FederatedCallback]) -> None:
    """Refuse two callbacks that both replace the server step, naming them.

    Raises:
        ValueError: If two callbacks set ``server_step`` and their pair is not composable.
    """
    steps = [(type(cb).__name__, cb.server_step) for cb in callbacks if cb.server_step]
    for i, (name_a, a) in enumerate(steps):
        for name_b, b in steps[i + 1 :]:
            if frozenset((a, b)) not in COMPOSABLE_SERVER_STEPS:
                raise ValueError(
                    f"{name_a} and {name_b} both replace the server step ({a!r} and {b!r}); their composition is "
                    "not defined: use one of them"
                )


# Server hooks that combine several clients' replies: a cycle has no such step, so methods built on one do not apply.
_AGGREGATING_HOOKS = ("on_reply", "on_mean", "on_aggregate")


def check_cyclic(callbacks: list[FederatedCallback]) -> None:
    """Refuse methods that need a server step over several replies, which a cycle does not have.

    Raises:
        ValueError: Naming the callbacks and the hooks they implement.
    """
    bad = {
        type(cb).__name__: [h for h in _AGGREGATING_HOOKS if getattr(type(cb), h) is not getattr(FederatedCallback, h)]
        for cb in callbacks
    }
    bad = {name: hooks for name, hooks in bad.items() if hooks}
    if bad:
        listed = "; ".join(f"{name} ({', '.join(hooks)})" for name, hooks in bad.items())
        raise ValueError(
            f"federation.topology=cyclic passes one model from client to client without a server step; these "
            f"callbacks combine the clients' replies on the server and do not apply: {listed}. Remove them from "
            "trainer.callbacks or use topology star"
        )
