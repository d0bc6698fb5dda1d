"""Flower engine: our Federation as a Flower ServerApp, our client runtime as a Flower ClientApp.

``[tool.flwr.app.components]`` in ``pyproject.toml`` names :data:`server_app` and :data:`client_app`, so
``flwr run .`` runs the project against a SuperLink (a real deployment, one SuperNode per site) or the
Simulation Engine. The run config names the YAML (``config``) and extra arguments (``overrides``); every
site's node config says which client(s) it hosts and where its data are (``fl-clients``, ``fl-args``, see
:mod:`fl_lightning.engines.flower_site`); a virtual SuperNode of the Simulation Engine hosts its share of the
clients by ``partition-id``. :func:`make_server_app` and :func:`make_client_app` build the same apps with a
run config of their own, for ``flwr.simulation.run_simulation`` (:mod:`fl_lightning.engines.flower_sim`).

**Wire format** (:mod:`fl_lightning.engines.flower_wire`). Every task and reply is our protocol's encoding (a
JSON header plus raw tensor bytes,
:mod:`fl_lightning.wire.protocol`) carried whole as one ``uint8`` :class:`flwr.app.Array` (``stype`` =
``fl_lightning.message``) in the ``ArrayRecord`` ``"fl.msg"``; a ``ConfigRecord`` ``"fl.meta"`` carries the
routing facts (the server's run name, the round, the oldest round a resume may need). One blob rather than
one ``Array`` per tensor: the protocol's decoder stays the only parser of what arrives (it never unpickles,
and we never call ``Array.numpy()``), nested payloads (tuples, maps, relayed tasks) need no second encoding,
and the bytes counted in ``rounds.csv`` are exactly what travels inside Flower's records.

**SecAgg+.** Fit tasks of :class:`callbacks.SecureAggregation` with ``scheme="secaggplus"`` run inside Flower's own
``secaggplus_mod`` (every ClientApp has it; it acts only on the protocol's messages): the transport drives its four
stages (:mod:`fl_lightning.engines.flower_secagg`), the update leaves a site only as the mod's masked vector, and
the encoded reply (without it) travels as bytes in the ``ConfigRecord`` ``"fl.reply"`` (the mod empties every
``ArrayRecord`` of a reply).

**Server.** :func:`run_server` asks every connected node to describe itself (client ids and sample counts,
the images' shape: no sample, no label), builds the model, Trainer and callbacks from the same YAML with
:class:`~fl_lightning.engines.flower_data.DescribedClients` in place of the data, and runs the unchanged
:class:`~fl_lightning.server.federation.Federation` over a :class:`FlowerTransport`. The run directory is the
simulation's (config, metrics, rounds, summary, curves, W&B offline run, server checkpoints) except
``partition.png``: the server does not know the sites' label distributions.

**Sites.** Each site keeps its runtime and writes its state to its own disk after every message (Flower
1.42 runs a fresh ``flwr-clientapp`` process per message in a deployment); a server checkpoint records only
the round, and resuming it makes each site load its own state of that round. Private state never leaves a site.
"""

from __future__ import annotations

import json
import shlex
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from typing_extensions import override

from fl_lightning.engines import flower_secagg as secaggplus
from fl_lightning.engines.flower_claims import claim_conflicts, client_order
from fl_lightning.engines.flower_site import SiteSettings, site_for
from fl_lightning.engines.flower_wire import (
    DESCRIBE,
    META,
    PRECONDITION,
    RESTORE,
    SHARED_KEYS,
    pack,
    parse_description,
    unpack,
)
from fl_lightning.errors import PreconditionError
from fl_lightning.startup.heap import import_long_lived
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import Reply, Task
from fl_lightning.wire.transport import Transport

APP_DIR = Path(__file__).resolve().parents[2]  # the project (or the installed FAB) holding configs/
# Run config keys ([tool.flwr.app.config] in pyproject.toml, or `flwr run . -c 'key=value'`).
RUN_DEFAULTS: dict[str, Any] = {
    "config": "configs/fedavg_digits.yaml",  # the run's YAML, relative to the app directory
    "overrides": "",  # extra command-line arguments after it (e.g. "--federation.rounds=5")
    "min-nodes": 1,  # wait for this many SuperNodes before the first message
    "node-wait": 300.0,  # seconds to wait for them
    "timeout": 3600.0,  # seconds a message may take before its client counts as failed (federation.reply_timeout wins)
    "poll": 0.05,  # seconds between two looks for a reply
}
_Answer = tuple[bytes, dict[str, Any], "str | None"]  # a node's reply bytes, its routing facts, or its error
_TYPES = {protocol.FIT: "train", protocol.EVALUATE: "evaluate"}  # every other kind is a "query"
# Tasks whose client may fail alone (the round, the evaluation or the statistics go on without it); any other
# task (a method's query, describe, restore) failing stops the run, as in one process.
FAILABLE = (protocol.FIT, protocol.EVALUATE, protocol.STATS)


def run_args(run_config: dict[str, Any]) -> list[str]:
    """The run's command-line arguments from its Flower run config (the same on the server and every site)."""
    cfg = {**RUN_DEFAULTS, **run_config}
    path = Path(str(cfg["config"]))
    return ["--config", str(path if path.is_absolute() else APP_DIR / path), *shlex.split(str(cfg["overrides"]))]


# ---------------------------------------------------------------------------------------------------- server
class FlowerTransport(Transport):
    """Tasks as Flower messages to the SuperNode hosting each client; replies come back the same way.

    Args:
        grid: The ServerApp's grid.
        timeout: Seconds a message may take; after it (or when the node reports an error) the client's fit
            or evaluation counts as failed, any other task stops the run.
        keep_checkpoints: The Federation's ``keep_checkpoints`` (which site states a resume may still need).
        poll: Seconds between two looks for a reply.

    """

    name = "flower"
    simulation = False  # real sites: no test predictions leave them (see Federation.evaluate)

    def __init__(self, grid: Grid, timeout: float = 3600.0, keep_checkpoints: int = 2, poll: float = 0.05) -> None:
        super().__init__()  # the runtimes live on the sites
        self.grid, self.timeout, self.keep, self.poll = grid, timeout, keep_checkpoints, poll
        self.routes: dict[str, int] = {}  # client id -> node id
        self.descriptions: dict[int, dict[str, Any]] = {}  # node id -> its description
        self.describe_errors: dict[int, str] = {}  # node id -> why it could not describe itself (latest try)
        self.refused: dict[int, str] = {}  # node id -> why it is never asked again (it claims another's client)
        self.run_key: str | None = None
        self.last_round = -1
        self.checkpoint_rounds: list[int] = []
        # (round, group) -> SecAgg+'s unmasked Σ p_i Δ_i and the clients whose masked vectors are in it
        self.secure_sums: dict[tuple[int, str], tuple[Any, list[str]]] = {}

    # Secure-aggregation schemes this transport runs (callbacks.SecureAggregation asks before it relies on one).
    secure_aggregation = ("secaggplus",)

    def take_secure_sum(self, round_idx: int, group: str) -> tuple[Any, list[str]] | None:
        """SecAgg+'s unmasked Σ p_i Δ_i (float64 tensor) of a round's fit wave and the clients in it, once.

        ``None`` if there is none. A client whose reply was malformed after its masked vector entered the sum is
        in it (an update cannot be taken out of a masked sum) though its reply failed.
        """
        return self.secure_sums.pop((round_idx, group), None)

    # ------------------------------------------------------------------ nodes
    def node_ids(self) -> list[int]:
        """The SuperNodes connected now."""
        return sorted(int(n) for n in self.grid.get_node_ids())

    def wait_for_nodes(self, minimum: int, wait: float) -> list[int]:
        """Block until ``minimum`` nodes are connected (or raise after ``wait`` seconds)."""
        deadline = time.monotonic() + wait
        while len(nodes := self.node_ids()) < minimum:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(nodes)} of {minimum} SuperNodes connected after {wait:.0f} s")
            time.sleep(0.5)
        return nodes

    def discover(self) -> dict[str, Any]:
        """Ask every node not described yet what it hosts; route its clients to it. Returns the merged description.

        A restarted SuperNode comes back under a new node id: its clients are routed to it from then on.
        """
        now = self.node_ids()
        new = [n for n in now if n not in self.descriptions and n not in self.refused]
        if new:
            answers = self._exchange([(n, pack(b"", op=DESCRIBE), f"query.{DESCRIBE}") for n in new])
            described: dict[int, dict[str, Any]] = {}
            for node, (data, _meta, error) in zip(new, answers):
                if error is None:
                    try:
                        described[node] = parse_description(data, node)
                    except (protocol.MessageError, ValueError) as err:
                        error = f"its description is malformed: {err}"
                if error is not None:
                    warnings.warn(f"SuperNode {node} could not describe itself: {error}", stacklevel=2)
                    self.describe_errors[node] = error
            live = {n: d for n, d in self.descriptions.items() if n in now}
            for node, why in claim_conflicts(live, described).items():
                warnings.warn(f"SuperNode {node} is refused: {why}", stacklevel=2)
                self.refused[node] = why
                described.pop(node)
            for node, desc in described.items():
                self.describe_errors.pop(node, None)
                self.descriptions[node] = desc
                for cid in desc["clients"]:
                    self.routes[cid] = node
        return self.description()

    def description(self) -> dict[str, Any]:
        """Every described client (in client-id order of the nodes' answers) and the data's shape."""
        if not self.descriptions:
            raise RuntimeError(
                f"no SuperNode described any client; errors: {self.describe_errors}, refused: {self.refused}"
            )
        first = next(iter(self.descriptions.values()))
        clients: dict[str, list[int]] = {}
        for desc in self.descriptions.values():
            for key in SHARED_KEYS:
                if desc[key] != first[key]:
                    raise ValueError(f"the sites disagree on {key}: {desc[key]} vs {first[key]}")
            clients.update(desc["clients"])
        ordered = dict(sorted(clients.items(), key=lambda kv: client_order(kv[0])))
        return {**{k: first[k] for k in SHARED_KEYS}, "clients": ordered}

    # ------------------------------------------------------------------ messages
    def _exchange(self, items: list[tuple[int, RecordDict, str]]) -> list[_Answer]:
        """Push one message per ``(node, content, message type)`` at once; wait for every reply, in that order."""
        out: list[_Answer] = []
        for (node, _content, _type), reply in zip(items, self._send(items)):
            out.append(self._unpack_reply(node, reply))
        return out

    def _unpack_reply(self, node: int, reply: Message | str) -> _Answer:
        if isinstance(reply, str):
            return b"", {}, reply
        if reply.has_error():
            if reply.error.code == ErrorCode.INVALID_FAB:  # the SuperNode's --trusted-entities refused the FAB
                why = f"no key of its --trusted-entities signed this FAB ({reply.error.reason})"
                where = "docs/how-to/across-sites.md, 'Approved code only'"
                return b"", {}, f"it refused to run this app: {why}; run the reviewed, signed release ({where})"
            return b"", {}, f"{reply.error.reason} (code {reply.error.code})"
        try:
            data, meta = unpack(reply.content)
        except protocol.MessageError as err:  # a malformed answer is that node's failure, not the run's
            return b"", {}, f"its answer is malformed: {err}"
        return data, meta, None

    def _send(self, items: list[tuple[int, RecordDict, str]]) -> list[Message | str]:
        """Push the messages at once; every reply message (or why none came) in their order, nothing decoded."""
        messages = [Message(content=c, dst_node_id=n, message_type=t, ttl=self.timeout) for n, c, t in items]
        ids = list(self.grid.push_messages(messages))
        at = {mid: i for i, mid in enumerate(ids)}
        out: dict[int, Message | str] = {}
        deadline = time.monotonic() + self.timeout
        while len(out) < len(ids):
            for reply in self.grid.pull_messages([m for m in ids if at[m] not in out]):
                i = at.get(reply.metadata.reply_to_message_id)
                if i is not None:
                    out[i] = reply
            if len(out) < len(ids):
                if time.monotonic() > deadline:
                    for i in range(len(ids)):
                        out.setdefault(i, f"no reply within {self.timeout:.0f} s")
                    break
                time.sleep(self.poll)
        return [out[i] for i in range(len(ids))]

    @override
    def request(self, task: Task) -> Reply:
        return next(iter(self.stream([task])))

    def stream(self, tasks: list[Task]) -> Iterator[Reply]:
        """Send the tasks of different clients at once (their sites work in parallel); replies in task order.

        Tasks for a client already in the batch wait for the next wave, so one client's tasks keep their order.
        """
        i = 0
        while i < len(tasks):
            wave: list[Task] = []
            while i < len(tasks) and all(t.client_id != tasks[i].client_id for t in wave):
                wave.append(tasks[i])
                i += 1
            yield from self._wave(wave)

    def _wave(self, tasks: list[Task]) -> list[Reply]:
        settings = {secaggplus.Settings.of_task(t.payloads) for t in tasks if t.kind == protocol.FIT}
        if settings - {None}:
            return self._secure_wave(tasks, settings)
        items, nodes = [], []
        for task in tasks:
            node = self._route(task.client_id)
            self.last_round = max(self.last_round, task.round)
            data = protocol.encode(task)
            self.bytes_down += len(data)
            content = pack(data, op="task", run=self.run_key, round=task.round, keep_from=self._keep_from())
            items.append((node, content, _TYPES.get(task.kind, "query")))
            nodes.append(node)
        replies = []
        for task, node, (answer, meta, error) in zip(tasks, nodes, self._exchange(items)):
            if PRECONDITION in meta:  # the method cannot work on that site: the run stops, as in one process
                raise PreconditionError(f"client {task.client_id!r} (SuperNode {node}): {meta[PRECONDITION]}")
            reply = None
            if error is None:
                self.bytes_up += len(answer)
                try:
                    reply = _reply_of(task, node, answer)
                except protocol.MessageError as err:
                    error = f"its reply is malformed: {err}"
            if error is not None:
                if task.kind in FAILABLE:
                    self.descriptions.pop(node, None)  # ask it again (or its restarted successor) next time
                    replies.append(Reply(task.client_id, task.group, error=f"its SuperNode {node} failed: {error}"))
                    continue
                raise RuntimeError(f"{task.kind} task {task.query or ''} for client {task.client_id!r}: {error}")
            replies.append(reply)
        return replies

    def _secure_wave(self, tasks: list[Task], settings: set[secaggplus.Settings | None]) -> list[Reply]:
        """A round's fit tasks under SecAgg+ (:func:`~fl_lightning.engines.flower_secagg.secure_fit`).

        SecAgg+ masks per SuperNode, so each task must go to a node of its own; the unmasked sum waits in
        :attr:`secure_sums` for the callback's server half.
        """
        if len(settings) != 1 or any(t.kind != protocol.FIT for t in tasks):
            raise PreconditionError("SecAgg+ runs on a wave of fit tasks that all ask for it with the same settings")
        (setting,) = settings
        assert setting is not None
        by_node: dict[int, Task] = {}
        for task in tasks:
            node = self._route(task.client_id)
            if node in by_node:
                raise PreconditionError(
                    f"SecAgg+ masks per SuperNode: clients {by_node[node].client_id!r} and {task.client_id!r} are on "
                    f"SuperNode {node}; host one client per node"
                )
            by_node[node] = task
        contents = {}
        for node, task in by_node.items():
            self.last_round = max(self.last_round, task.round)
            data = protocol.encode(task)
            self.bytes_down += len(data)
            contents[node] = pack(data, op="task", run=self.run_key, round=task.round, keep_from=self._keep_from())

        def send(items: list[tuple[int, RecordDict]]) -> list[Message | str]:
            return self._send([(node, content, "train") for node, content in items])

        answers, total = secaggplus.secure_fit(send, contents, setting)
        replies, summed = {}, []
        for node, task in by_node.items():
            answer_ = answers[node]
            data, meta, error = self._unpack_reply(node, answer_)
            if PRECONDITION in meta:
                raise PreconditionError(f"client {task.client_id!r} (SuperNode {node}): {meta[PRECONDITION]}")
            if error is None and total is None:
                error = "SecAgg+ could not unmask the round's sum"
            if error is not None:
                self.descriptions.pop(node, None)
                replies[task.client_id] = Reply(
                    task.client_id, task.group, error=f"its SuperNode {node} failed: {error}"
                )
                continue
            masked = secaggplus.masked_bytes(answer_)
            self.bytes_up += len(data) + masked
            summed.append(task.client_id)
            try:
                replies[task.client_id] = _reply_of(task, node, data)
            except protocol.MessageError as err:  # its update is in the sum (and its weight); its reply failed
                self.descriptions.pop(node, None)
                replies[task.client_id] = Reply(
                    task.client_id, task.group, error=f"its SuperNode {node} failed: its reply is malformed: {err}"
                )
        if total is not None:
            import torch

            self.secure_sums[(tasks[0].round, tasks[0].group)] = (torch.from_numpy(total), summed)
        return [replies[t.client_id] for t in tasks]

    def _route(self, client_id: str) -> int:
        if client_id not in self.routes or self.routes[client_id] not in self.descriptions:
            self.discover()
        elif set(self.node_ids()) - set(self.descriptions):
            self.discover()  # a new node (e.g. a restarted site) may host it now
        if client_id not in self.routes:
            raise KeyError(f"no SuperNode hosts client {client_id!r}")
        return self.routes[client_id]

    def _keep_from(self) -> int | None:
        if not self.keep or len(self.checkpoint_rounds) < self.keep:
            return None
        return self.checkpoint_rounds[-self.keep]

    # ------------------------------------------------------------------ life cycle and checkpoints
    def prepare(self) -> None:
        """Nothing to do here: each site prepares its own runtime when it is built."""

    def start(self, workdir: Any) -> None:
        """Name the run on the sites after the server's run directory (their state lives under that name)."""
        self.run_key = Path(workdir).name

    def runtime_state(self) -> dict[str, Any]:
        """No site state: only the round whose site states the checkpoint stands for (each site keeps its own)."""
        self.checkpoint_rounds.append(self.last_round)
        return {"engine": self.name, "run": self.run_key, "round": self.last_round}

    def load_runtime_state(self, state: dict[str, Any]) -> None:
        """Make every site load its own state of the checkpoint's round (and drop newer ones)."""
        if state.get("engine") != self.name:
            raise ValueError("this checkpoint holds the client states of a simulation, not of a Flower deployment")
        self.run_key, self.last_round = state["run"], int(state["round"])
        self.checkpoint_rounds = [self.last_round]
        self.discover()
        nodes = list(self.descriptions)
        content = {"op": RESTORE, "run": self.run_key, "round": self.last_round}
        answers = self._exchange([(n, pack(b"", **content), f"query.{RESTORE}") for n in nodes])
        for node, (_data, meta, error) in zip(nodes, answers):
            if PRECONDITION in meta:
                raise PreconditionError(f"SuperNode {node}: {meta[PRECONDITION]}")
            if error is not None:
                raise RuntimeError(f"SuperNode {node} could not restore its state of round {self.last_round}: {error}")


def _reply_of(task: Task, node: int, data: bytes) -> Reply:
    """A node's encoded reply to ``task``, checked: a reply, and for the task's client."""
    try:
        reply = protocol.decode(data)
    except protocol.MessageError as err:
        raise protocol.MessageError(f"reply of client {task.client_id!r} (SuperNode {node}): {err}") from None
    if not isinstance(reply, Reply):
        raise protocol.MessageError(f"expected a reply from SuperNode {node}, got {type(reply).__name__}")
    if reply.client_id != task.client_id:
        raise protocol.MessageError(f"SuperNode {node} answered a task of {task.client_id!r} for {reply.client_id!r}")
    return reply


def run_server(grid: Grid, run_config: dict[str, Any]) -> dict[str, Any]:
    """The ServerApp's work: describe the sites, build the server from the YAML, run the Federation over Flower.

    Returns:
        The run's summary (also in ``summary.json`` of its run directory).

    """
    import os
    import threading

    os.environ.setdefault("WANDB_SILENT", "true")
    cfg = {**RUN_DEFAULTS, **run_config}
    args = run_args(cfg)
    # The sites describe themselves first: a site's first answer builds it (imports Lightning, reads its data:
    # seconds), and so does the server's import of Lightning, which runs meanwhile.
    importer = threading.Thread(target=import_server, name="fl-import-server", daemon=True)
    importer.start()
    transport = FlowerTransport(grid, float(cfg["timeout"]), poll=float(cfg["poll"]))
    transport.wait_for_nodes(int(cfg["min-nodes"]), float(cfg["node-wait"]))
    desc = transport.discover()
    # Nodes hosting a partition (the Simulation Engine's) say how many there are: every one of them must be
    # described before the clients are fixed, whatever `min-nodes` says (the engine registers them one by one).
    partitions = max((int(d.get("partitions", 0)) for d in transport.descriptions.values()), default=0)
    if partitions > len(transport.descriptions):
        transport.wait_for_nodes(partitions, float(cfg["node-wait"]))
        desc = transport.discover()
        if partitions > len(transport.descriptions):  # a missing partition is missing clients: no silent run
            raise RuntimeError(
                f"{len(transport.descriptions)} of {partitions} partitions described themselves; errors: "
                f"{transport.describe_errors}"
            )
    importer.join()
    from fl_lightning.cli import build_cli, config_yaml
    from fl_lightning.server.federation import Federation

    data_args = [
        "--data=fl_lightning.engines.flower_data.DescribedClients",
        f"--data.description={json.dumps(desc)}",
        f"--data.batch_size={desc['batch_size']}",
        f"--data.seed={desc['seed']}",
    ]
    cli = build_cli([*args, *data_args])
    # What the run directory records is the run's own config (its data section as the sites read it).
    original = cli.parser.parse_args(args)
    fed_cfg = cli.config_init["federation"]
    transport.keep = fed_cfg.keep_checkpoints
    if fed_cfg.reply_timeout is not None:  # the run's YAML wins over the Flower run config's `timeout`
        transport.timeout = float(fed_cfg.reply_timeout)
    # What a deployment's server may not have (test predictions, the sites' labels for partition.png) the Federation
    # leaves out itself: this transport is not a simulation's (FlowerTransport.simulation).
    federation = Federation(
        fed_cfg,
        module=cli.model,
        datamodule=cli.datamodule,
        trainer=cli.trainer,
        seed=int(cli.config["seed_everything"]),
        config_text=config_yaml(cli.parser, original),
        config_dict=original.clone().as_dict(),
        transport=transport,
    )
    return federation.run()


def import_server() -> None:
    """What the server builds its Federation with (Lightning; out of the collector's way, see heap.py)."""
    import_long_lived("fl_lightning.cli", "fl_lightning.server.federation")


def make_server_app(
    run_config: dict[str, Any] | None = None, on_summary: Callable[[dict[str, Any]], None] | None = None
) -> ServerApp:
    """A ServerApp running :func:`run_server`.

    Args:
        run_config: Run config entries that override the context's (``flwr.simulation.run_simulation`` gives
            the apps an empty run config; :mod:`fl_lightning.engines.flower_sim` passes the run's here).
        on_summary: Called with the run's summary when the Federation is done.

    """
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        summary = run_server(grid, {**dict(context.run_config), **(run_config or {})})
        if on_summary is not None:
            on_summary(summary)

    return app


# ---------------------------------------------------------------------------------------------------- site
def answer(
    message: Message,
    context: Context,
    run_config: dict[str, Any] | None = None,
    node_defaults: dict[str, Any] | None = None,
) -> Message:
    """A site's answer to one message: describe, restore, or a task for its runtime.

    Args:
        message: The server's message.
        context: The node's Flower context (its run config and node config).
        run_config: Run config entries that override the context's (see :func:`make_server_app`).
        node_defaults: Node config entries for what the node's own config leaves out (the Simulation Engine's
            virtual nodes know only ``partition-id`` and ``num-partitions``; e.g. ``fl-state-dir``).

    """
    data, meta = unpack(message.content)
    run_cfg = {**dict(context.run_config), **(run_config or {})}
    node_cfg = {**(node_defaults or {}), **dict(context.node_config)}
    site = site_for(context.run_id, run_args(run_cfg), SiteSettings.from_node_config(node_cfg))
    op = meta.get("op", "task")
    if op == DESCRIBE:
        return Message(pack(json.dumps(site.describe()).encode()), reply_to=message)
    if "run" not in meta or "round" not in meta:
        raise protocol.MessageError(f"a {op} message names its run and round; it has {sorted(meta)}")
    round_index = meta["round"]
    try:
        site.open_run(meta["run"], round_index)
        if op == RESTORE:
            site.restore(round_index)
            return Message(pack(b""), reply_to=message)
        if secaggplus.RECORD_KEY_CONFIGS in message.content.config_records:  # a fit inside Flower's SecAgg+ mod
            return Message(_secure_reply(site, data, meta.get("keep_from")), reply_to=message)
        out = site.handle(data, meta.get("keep_from"))
    except PreconditionError as err:
        # Not one client's failure: the server stops the run with this message (Flower would only report that
        # the ClientApp raised, and the client would count as failed).
        return Message(pack(b"", **{PRECONDITION: str(err)}), reply_to=message)
    return Message(pack(out), reply_to=message)


def _secure_reply(site: Any, data: bytes, keep_from: int | None) -> RecordDict:
    """A SecAgg+ fit's reply: p_i Δ_i only as the ``FitRes`` the mod masks; our encoded reply (without it) beside."""
    task, reply = site.answer_task(data, keep_from)
    settings = secaggplus.Settings.of_task(task.payloads)
    if task.kind != protocol.FIT or settings is None or reply.error is not None:
        raise protocol.MessageError(f"a SecAgg+ stage carried a {task.kind} task that cannot be masked: {reply.error}")
    update = secaggplus.take_update(reply)
    if update.size != settings.size:
        raise ValueError(
            f"client {task.client_id!r}: an update of {update.size} entries, SecAgg+ expects {settings.size}"
        )
    content = secaggplus.fitres_records(update, settings)
    content.config_records[secaggplus.REPLY_RECORD] = ConfigRecord({"message": protocol.encode(reply)})
    content.config_records[META] = ConfigRecord({})
    return content


def make_client_app(run_config: dict[str, Any] | None = None, node_defaults: dict[str, Any] | None = None) -> ClientApp:
    """A ClientApp whose every message (train, evaluate, queries) goes to :func:`answer`.

    The arguments are :func:`answer`'s; they travel with the app (the Simulation Engine pickles it to its actors).
    """
    # Flower's SecAgg+ mod acts on the protocol's messages only (flower_secagg.client_mod).
    app = ClientApp(mods=[secaggplus.client_mod])

    def _answer(message: Message, context: Context) -> Message:
        return answer(message, context, run_config, node_defaults)

    for register in (app.train(), app.evaluate(), app.query(), app.query(DESCRIBE), app.query(RESTORE)):
        register(_answer)
    return app


# What `flwr run` loads ([tool.flwr.app.components]): the run config and node config come from Flower.
server_app = make_server_app()
client_app = make_client_app()
