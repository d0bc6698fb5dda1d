"""The base class of every federation mechanism: a Lightning callback with a server half and a client half."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import lightning as L

if TYPE_CHECKING:  # type hints only: the core never imports a method
    from torch.utils.data import DataLoader

    from fl_lightning.federation import Federation
    from fl_lightning.ops.state import StateDict
    from fl_lightning.protocol import Reply, Task
    from fl_lightning.runtime import ClientContext, ClientRuntime
    from fl_lightning.state import ModelGroup


class FederatedCallback(L.Callback):
    """A Lightning callback that takes part in the federated round, on both sides of the boundary.

    One method is one file with two halves that talk only through messages
    (:class:`~fl_lightning.protocol.Task` / :class:`~fl_lightning.protocol.Reply` payloads):

    **Server half** (called by the :class:`~fl_lightning.federation.Federation`, which it may read):
    ``on_federation_start`` → each round ``on_round_start`` → per task ``configure_task`` (add a payload
    with :meth:`put_payload`, or set the task's budget) → per reply ``on_reply`` (read payloads with
    :meth:`get_payload`) → per group ``on_mean`` → ``on_aggregate`` → ``on_pass_on`` (peer-to-peer) → evaluation
    (``extra_evaluation``) → ``on_round_end``. ``state_dict``/``load_state_dict`` hold the server half's state.

    **Client half** (called by the :class:`~fl_lightning.runtime.ClientRuntime`; never sees the Federation):
    ``on_runtime_start`` once → per fit ``on_client_start`` → ``wrap_train_loader`` → the usual Lightning
    hooks during the local fit → ``on_client_end`` → ``on_upload``; named queries go to ``answer_query``. Each hook
    gets a :class:`~fl_lightning.runtime.ClientContext`: the client id, round, this callback's task payload, the
    received global state and the client's private state for this callback (``ctx.state``, a dict the
    runtime keeps and checkpoints per client).

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

    # ------------------------------------------------------------------ payload helpers
    def put_payload(self, message: Task | Reply, payload: Any) -> None:
        """Attach this callback's payload to a task (server half) or a reply (client half)."""
        message.payloads[self.state_key] = payload

    def get_payload(self, message: Task | Reply, default: Any = None) -> Any:
        """The payload of this callback in a task or reply (``default`` if there is none)."""
        return message.payloads.get(self.state_key, default)

    # ------------------------------------------------------------------ server half
    def on_federation_start(self, server: Federation) -> None:
        """Server: once before the first round (and again after a resume); check preconditions here."""

    def on_round_start(self, server: Federation, round_idx: int, selected: list[str]) -> None:
        """Server: before any task of round ``round_idx`` is sent."""

    def configure_task(self, server: Federation, task: Task) -> None:
        """Server: before a ``fit`` task is sent; add a payload (:meth:`put_payload`) or set its budget."""

    def on_reply(self, server: Federation, task: Task, reply: Reply, weight: float) -> None:
        """Server: a successful ``fit`` reply arrived, before it enters its group's mean with ``weight``.

        Replies are handled in the order of the round's selection, whatever order they arrived in.
        """

    def on_aggregate(
        self, server: Federation, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        """Server: return the group's new global state given the previous one and the weighted average."""
        return averaged

    def on_mean(self, server: Federation, group: ModelGroup, previous: StateDict, averaged: StateDict) -> StateDict:
        """Server: the group's weighted mean of the uploads, before any callback's ``on_aggregate`` sees it.

        For a callback that changes what the uploads are rather than how they are combined (secure aggregation
        puts the unmasked sum here), so every ``on_aggregate`` (FedOpt, DP-FedAvg) sees the plain mean whatever
        the callbacks' order. Most methods use ``on_aggregate``.
        """
        return averaged

    def moves_models(self) -> bool:
        """Peer-to-peer only: whether models travel to the successor (False keeps them on their node)."""
        return True

    def on_pass_on(self, server: Federation, round_idx: int, successor: dict[str, str]) -> None:
        """Server, peer-to-peer only: the round's cycle (node → successor); relay what the nodes pass on."""

    def on_round_end(self, server: Federation, round_idx: int, metrics: dict[str, Any]) -> None:
        """Server: after aggregation, evaluation and recording; entries added to ``metrics`` are written too."""

    def extra_evaluation(self, server: Federation) -> dict[str, dict[str, dict[str, float]]]:
        """Server: models the callback evaluates (through query tasks), as ``{model: {client: metrics}}``."""
        return {}

    def summary_entries(self, server: Federation) -> dict[str, Any]:
        """Server: entries the callback adds to ``summary.json`` (e.g. a clustering's quality)."""
        return {}

    # ------------------------------------------------------------------ client half
    def on_runtime_start(self, runtime: ClientRuntime) -> None:
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
