"""A site's side of a Flower deployment, without Flower: build its client runtime, describe it, keep its state on disk.

A SuperNode runs the run's ClientApp once per message (Flower 1.42 starts a fresh ``flwr-clientapp`` process
for every message in a deployment; the Simulation Engine calls it in a long-lived process). So a site keeps
its runtime in a process-level cache (:func:`site_for`) *and* writes the runtime's state (private states,
optimiser states, the callbacks' client states, sampler counters) to the node's own disk after every message
that may change it: a fresh process, or a restarted node, picks up where the last message left it.

State files live in ``<state dir>/<run name>/``: ``round-NNNNN.flm`` is the state after this site's last
message of round N (the protocol's encoding: plain data, nothing is unpickled when a node reads it back).
The server's checkpoint of round N names round N; resuming it makes every site drop its newer files and
load the newest one up to N. Large files of callbacks (FedER's generators) go into the same directory.

**Simulation Engine.** A virtual SuperNode's node config is only ``partition-id`` and ``num-partitions``:
without ``fl-clients``, node ``i`` of ``n`` hosts the clients at positions ``p % n == i`` of its data's client
order, and keeps its state in ``<state dir>/partition-<i>``. Every Ray actor serves any virtual node, so one
process may hold the sites of several nodes, and one node's messages may be answered by different processes
in turn: each message is answered under a lock on the node's state directory, after loading the node's
newest state from disk when another process wrote it (:meth:`Site.handle`). The sites of one process share
one build of the run's arguments (module, data, Trainer) unless a callback is ``runtime_bound``.
"""

from __future__ import annotations

import os
import re
import shlex
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: one process per node is then the only safe set-up
    fcntl = None  # type: ignore[assignment]

from fl_lightning.startup.heap import import_long_lived, long_lived
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import Reply, Task

if TYPE_CHECKING:
    from fl_lightning.runtime import ClientRuntime

# Node config keys (``flower-supernode --node-config 'fl-clients="site-a" fl-args="--data.path=/srv/a.npz"'``).
NODE_CLIENTS = "fl-clients"  # comma-separated client ids this node hosts (default: every client of its data)
NODE_ARGS = "fl-args"  # the site's own arguments after the run's (its data: class, path, ...)
NODE_STATE_DIR = "fl-state-dir"  # where the site's private state and large files go
# What the Simulation Engine gives each virtual SuperNode (and Flower's convention for real ones).
NODE_PARTITION_ID, NODE_NUM_PARTITIONS = "partition-id", "num-partitions"
DEFAULT_STATE_DIR = "~/.fl_lightning/flower"
_STATE_FILE = re.compile(r"round-(\d+)\.flm$")
_RUN_KEY = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


@dataclass(frozen=True)
class SiteSettings:
    """What a node says about itself (its Flower node config), parsed.

    Attributes:
        clients: The client ids this node hosts (``None``: decided by ``partition``, else every client its
            data hold).
        args: The site's own command-line arguments, appended after the run's (e.g. its data path).
        state_dir: The directory of its private state and large files.
        partition: ``(partition id, number of partitions)`` when the node hosts a share of its data's clients
            (the Simulation Engine's node config) rather than named ones.

    """

    clients: tuple[str, ...] | None = None
    args: tuple[str, ...] = ()
    state_dir: Path = field(default_factory=lambda: Path(DEFAULT_STATE_DIR).expanduser())
    partition: tuple[int, int] | None = None

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> SiteSettings:
        """Parse ``fl-clients``, ``fl-args``, ``fl-state-dir``, ``partition-id`` and ``num-partitions`` (all optional).

        ``fl-clients`` wins over a partition. A partition's state goes to ``<fl-state-dir>/partition-<i>``: the
        virtual nodes of a simulation share one machine, and one state directory would mix their states.

        Raises:
            ValueError: If only one of ``partition-id``/``num-partitions`` is given, or the id is not in
                ``0 .. num-partitions - 1``.

        """
        clients = node_config.get(NODE_CLIENTS)
        ids = tuple(c.strip() for c in str(clients).split(",") if c.strip()) if clients not in (None, "") else None
        try:
            args = tuple(shlex.split(str(node_config.get(NODE_ARGS, ""))))
        except ValueError as err:  # an unclosed quote
            raise ValueError(f"node config {NODE_ARGS}={node_config[NODE_ARGS]!r} is no command line: {err}") from None
        state_dir = Path(str(node_config.get(NODE_STATE_DIR) or DEFAULT_STATE_DIR)).expanduser()
        partition = None
        if ids is None and (NODE_PARTITION_ID in node_config or NODE_NUM_PARTITIONS in node_config):
            partition = _partition(node_config)
            state_dir = state_dir / f"partition-{partition[0]}"
        return cls(ids, args, state_dir, partition)

    def hosted(self, data_ids: list[str]) -> list[str]:
        """The client ids this node hosts, out of its data's ``data_ids`` (in client order).

        Raises:
            ValueError: If ``fl-clients`` names a client the data do not hold, or there are more partitions
                than clients (a node would host none).

        """
        if self.clients is not None:
            unknown = [c for c in self.clients if c not in data_ids]
            if unknown:
                raise ValueError(f"node config {NODE_CLIENTS} names {unknown}, which its data do not hold ({data_ids})")
            return list(self.clients)
        if self.partition is not None:
            index, count = self.partition
            if count > len(data_ids):
                raise ValueError(
                    f"node config {NODE_NUM_PARTITIONS}={count} (this node's {NODE_PARTITION_ID}={index}) exceeds the "
                    f"{len(data_ids)} clients of its data: some nodes would host none; use at most {len(data_ids)}"
                )
            return data_ids[index::count]
        return list(data_ids)


def _partition(node_config: dict[str, Any]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of a node config, checked."""
    missing = [k for k in (NODE_PARTITION_ID, NODE_NUM_PARTITIONS) if k not in node_config]
    if missing:
        raise ValueError(f"node config gives {NODE_PARTITION_ID} and {NODE_NUM_PARTITIONS} together; {missing} missing")
    try:
        index, count = (_integer(node_config[k]) for k in (NODE_PARTITION_ID, NODE_NUM_PARTITIONS))
    except (TypeError, ValueError):
        raise ValueError(
            f"node config {NODE_PARTITION_ID}={node_config[NODE_PARTITION_ID]!r} and "
            f"{NODE_NUM_PARTITIONS}={node_config[NODE_NUM_PARTITIONS]!r} must be integers"
        ) from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(
            f"node config {NODE_PARTITION_ID}={index} must lie in 0 .. {NODE_NUM_PARTITIONS}-1 "
            f"({NODE_NUM_PARTITIONS}={count})"
        )
    return index, count


def _integer(value: Any) -> int:
    """An integer node config value (also as text); no bool, no fraction (``int()`` would truncate 1.5 to 1)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{value!r} is no integer")
    return int(value)


class SiteBuild:
    """What a site's command line builds: client module, data, Trainer (with the callbacks), federation settings.

    The runtimes of several nodes may share one (:meth:`runtime`, :attr:`shareable`).

    Args:
        args: The run's command-line arguments followed by the node's own.

    """

    def __init__(self, args: list[str]) -> None:
        from fl_lightning.cli import build_cli  # heavy: only when a site is built

        os.environ.setdefault("WANDB_SILENT", "true")
        # A site logs nothing itself (the server's run directory holds the run's records).
        cli = build_cli([*args, "--trainer.logger=false"], log=False)
        self.module, self.data, self.trainer = cli.model, cli.datamodule, cli.trainer
        self.config, self.seed = cli.config_init["federation"], int(cli.config["seed_everything"])
        self._prepared = False

    @property
    def shareable(self) -> bool:
        """Whether runtimes of other nodes may use this build: no callback is ``runtime_bound``."""
        return not any(getattr(cb, "runtime_bound", False) for cb in self.trainer.callbacks)

    def runtime(self, client_ids: list[str]) -> ClientRuntime:
        """A runtime hosting ``client_ids`` (the first one adds the callbacks' layers to the module)."""
        from fl_lightning.runtime import ClientRuntime

        runtime = ClientRuntime(
            self.module, self.data, self.trainer, self.config, self.seed, prepared=self._prepared, client_ids=client_ids
        )
        runtime.prepare()
        self._prepared = True
        return runtime


class Site:
    """One node's client runtime, built from the run's arguments plus the node's own.

    Args:
        run_args: The run's command-line arguments (``--config <yaml>`` and overrides), the same on every node.
        settings: The node's own settings.
        build: What the node's arguments build, when the process has it already (another node's, shareable);
            built here otherwise.

    """

    def __init__(self, run_args: list[str], settings: SiteSettings, build: SiteBuild | None = None) -> None:
        self.build = build or SiteBuild([*run_args, *settings.args])
        self.settings = settings
        self.clients = settings.hosted(list(self.build.data.client_ids))
        self.runtime = self.build.runtime(self.clients)
        self.run_key: str | None = None
        self._synced: tuple[int, ...] | None = None  # (round, mtime, inode, size) of the state file in memory now

    # ------------------------------------------------------------------ what the server may know
    def describe(self) -> dict[str, Any]:
        """Metadata only: hosted client ids and sample counts, the data's shape (no sample, no label), partitions."""
        data = self.runtime.data
        out: dict[str, Any] = {
            "clients": {
                c: [data.num_train_samples(c), data.num_test_samples(c), data.num_val_samples(c)] for c in self.clients
            },  # fmt: skip
            "batch_size": int(data.batch_size),
            "num_classes": int(data.num_classes),
            "in_channels": int(data.in_channels),
            "image_size": [int(s) for s in data.image_size],
            "seed": int(data.seed),
        }
        if self.settings.partition is not None:  # the server waits for every partition before fixing the clients
            out["partitions"] = self.settings.partition[1]
        return out

    # ------------------------------------------------------------------ state on disk
    def run_dir(self) -> Path:
        """The directory of the current run on the node."""
        assert self.run_key is not None
        return self.settings.state_dir / self.run_key

    def open_run(self, run_key: str, round_index: int | None) -> None:
        """Serve the server run ``run_key``: start the runtime there and load its newest state up to the round."""
        if run_key == self.run_key:
            return
        if not _RUN_KEY.match(run_key):
            raise protocol.MessageError(f"invalid run name {run_key!r}")
        self.run_key = run_key
        self.run_dir().mkdir(parents=True, exist_ok=True)
        try:
            self.runtime.start(self.run_dir())  # the callbacks' checks (PreconditionError)
        except BaseException:
            self.run_key = None  # not started: the next message starts (and checks) again
            raise
        with self._exclusive():
            self._synced = None
            self._load_newest(round_index)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the node's lock: its processes (the Simulation Engine's actors) answer its messages one at a time."""
        if fcntl is None:
            yield
            return
        with open(self.run_dir() / ".lock", "a+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _files(self) -> dict[int, Path]:
        out = {}
        for path in self.run_dir().glob("round-*.flm"):
            m = _STATE_FILE.search(path.name)
            if m:
                out[int(m.group(1))] = path
        return out

    @staticmethod
    def _signature(round_index: int, path: Path) -> tuple[int, ...]:
        st = path.stat()
        return round_index, st.st_mtime_ns, st.st_ino, st.st_size

    def _load_newest(self, up_to: int | None) -> int | None:
        """Load the newest state file up to round ``up_to`` unless it is the one in memory already."""
        files = {r: p for r, p in self._files().items() if up_to is None or r <= up_to}
        if not files:
            return None
        newest = max(files)
        signature = self._signature(newest, files[newest])
        if signature != self._synced:  # another process (or an earlier run of this one) wrote it
            self.runtime.load_state_dict(read_state(files[newest]))
            self._synced = signature
        return newest

    def save(self, round_index: int, keep_from: int | None = None) -> Path:
        """Write the runtime's state as the state of round ``round_index`` (atomically); prune what no resume needs.

        ``keep_from``: the oldest round the server may still resume from; older files go, except the newest of them.
        """
        path = self.run_dir() / f"round-{round_index:05d}.flm"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(protocol.encode(self.runtime.state_dict()))
        os.replace(tmp, path)
        self._synced = self._signature(round_index, path)
        if keep_from is not None and keep_from >= 0:
            older = sorted(r for r in self._files() if r <= keep_from)
            for r in older[:-1]:
                self._files()[r].unlink(missing_ok=True)
        return path

    def restore(self, round_index: int) -> int | None:
        """Resume the server's checkpoint of round ``round_index``: drop newer files, load the newest up to it."""
        with self._exclusive():
            for r, path in self._files().items():
                if r > round_index:
                    path.unlink(missing_ok=True)
            self._synced = None
            return self._load_newest(round_index)

    # ------------------------------------------------------------------ tasks
    def handle(self, data: bytes, keep_from: int | None = None) -> bytes:
        """Answer an encoded task with an encoded reply; persist the state unless the task only reads.

        Under the node's lock, and from its newest state on disk: in the Simulation Engine another process may
        have answered this node's previous message.
        """
        return protocol.encode(self.answer_task(data, keep_from)[1])

    def answer_task(self, data: bytes, keep_from: int | None = None) -> tuple[Task, Reply]:
        """:meth:`handle`, returning the decoded task and the reply before encoding (SecAgg+ takes a part out)."""
        task = protocol.decode_task(data)
        if task.round < 0:  # it names the state file written after it
            raise protocol.MessageError(f"task of round {task.round} (rounds count from 0)")
        if keep_from is not None and type(keep_from) is not int:
            raise protocol.MessageError(f"keep_from is a round, not {keep_from!r}")
        if task.client_id not in self.clients:
            hosted = self.clients
            raise protocol.MessageError(f"client {task.client_id!r} is not hosted here (this node hosts {hosted})")
        with self._exclusive():
            self._load_newest(task.round)
            try:
                reply = self.runtime.handle(task)
            except BaseException:
                self._synced = None  # the runtime may be half-changed: the next message reloads the saved state
                raise
            if task.kind != protocol.EVALUATE:
                self.save(task.round, keep_from)
        return task, reply


def read_state(path: Path) -> dict[str, Any]:
    """A runtime state file back from disk (the protocol's decoder: nothing is unpickled).

    Raises:
        protocol.MessageError: If the file is not an encoded runtime state (a dict), naming it.

    """
    try:
        state = protocol.decode(path.read_bytes())
    except protocol.MessageError as err:
        raise protocol.MessageError(f"state file {path} is damaged: {err}") from None
    if not isinstance(state, dict):
        raise protocol.MessageError(f"state file {path} holds a {type(state).__name__}, not a runtime state")
    return state


_SITES: dict[tuple[Any, ...], Site] = {}
_BUILDS: dict[tuple[Any, ...], SiteBuild] = {}


_WARM_UP: threading.Thread | None = None


def warm_up() -> None:
    """Start importing what a site builds with (Lightning, the CLI, the runtime) in a thread of this process.

    The Simulation Engine's Ray actors call this when their process starts (Ray's ``worker_process_setup_hook``,
    set by :mod:`fl_lightning.engines.flower_sim`): an actor would otherwise import Lightning (≈ 4–5 s of CPU)
    only when its first message arrives, after Ray and the ServerApp have started. :func:`site_for` waits for
    the thread before it builds. A failed import is left to that build, which imports again and raises.
    """
    global _WARM_UP

    def run() -> None:
        try:
            import_long_lived("fl_lightning.cli", "fl_lightning.runtime")
        except Exception:  # noqa: BLE001, S110 - the site's build imports again and reports the error
            pass

    if _WARM_UP is None:
        _WARM_UP = threading.Thread(target=run, name="fl-site-warm-up", daemon=True)
        _WARM_UP.start()


def _honour_omp_num_threads() -> None:
    """Give torch the ``OMP_NUM_THREADS`` the process has now (Ray sets it for an actor after the warm-up began).

    torch's thread pool takes its size when torch loads; loaded before Ray set the variable to the actor's CPUs,
    it would use every core, and two actors on two cores then run several times slower.
    """
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))


def site_for(flower_run: Any, run_args: list[str], settings: SiteSettings) -> Site:
    """The process's site of a node in a Flower run (built on the first message the process sees for that node).

    One run at a time per process: a new run drops the previous run's sites (module, data and Trainer). Within
    a run a process keeps one site per node it served: in the Simulation Engine every Ray actor answers any
    virtual SuperNode's messages. The nodes' sites share one build of the run's arguments (parsed once, one
    module, data and Trainer) unless a callback is ``runtime_bound``: each node only adds a runtime for its
    clients (≈ 10 ms instead of ≈ 0.3–0.7 s of parsing and instantiating for each further node).
    """
    global _WARM_UP
    if _WARM_UP is not None:  # once per process, not per message
        _WARM_UP.join()  # one import at a time: long_lived's collector switch is per process, not per thread
        _WARM_UP = None
        _honour_omp_num_threads()
    run = (flower_run, tuple(run_args))
    if any(key[:2] != run for key in [*_SITES, *_BUILDS]):
        _SITES.clear()
        _BUILDS.clear()
    key = (*run, settings)
    if key not in _SITES:
        # A site's process (a SuperNode's executor, a Ray actor) serves the run's messages for as long as it
        # lives: what it imports and builds here stays (see heap.py).
        with long_lived():
            shared = (*run, settings.args)
            site = _SITES[key] = Site(run_args, settings, _BUILDS.get(shared))
            if site.build.shareable:
                _BUILDS[shared] = site.build
    return _SITES[key]
