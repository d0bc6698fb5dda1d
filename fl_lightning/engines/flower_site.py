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
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_lightning import protocol
from fl_lightning.protocol import Task

# Node config keys (``flower-supernode --node-config 'fl-clients="site-a" fl-args="--data.path=/srv/a.npz"'``).
NODE_CLIENTS = "fl-clients"  # comma-separated client ids this node hosts (default: every client of its data)
NODE_ARGS = "fl-args"  # the site's own arguments after the run's (its data: class, path, ...)
NODE_STATE_DIR = "fl-state-dir"  # where the site's private state and large files go
DEFAULT_STATE_DIR = "~/.fl_lightning/flower"
_STATE_FILE = re.compile(r"round-(\d+)\.flm$")
_RUN_KEY = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


@dataclass(frozen=True)
class SiteSettings:
    """What a node says about itself (its Flower node config), parsed.

    Attributes:
        clients: The client ids this node hosts (``None``: every client its data hold).
        args: The site's own command-line arguments, appended after the run's (e.g. its data path).
        state_dir: The directory of its private state and large files.

    """

    clients: tuple[str, ...] | None = None
    args: tuple[str, ...] = ()
    state_dir: Path = field(default_factory=lambda: Path(DEFAULT_STATE_DIR).expanduser())

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> SiteSettings:
        """Parse ``fl-clients``, ``fl-args`` and ``fl-state-dir`` (every one optional)."""
        clients = node_config.get(NODE_CLIENTS)
        ids = tuple(c.strip() for c in str(clients).split(",") if c.strip()) if clients not in (None, "") else None
        args = tuple(shlex.split(str(node_config.get(NODE_ARGS, ""))))
        state_dir = Path(str(node_config.get(NODE_STATE_DIR) or DEFAULT_STATE_DIR)).expanduser()
        return cls(ids, args, state_dir)


class Site:
    """One node's client runtime, built from the run's arguments plus the node's own.

    Args:
        run_args: The run's command-line arguments (``--config <yaml>`` and overrides), the same on every node.
        settings: The node's own settings.

    """

    def __init__(self, run_args: list[str], settings: SiteSettings) -> None:
        from fl_lightning.cli import build_cli  # heavy: only when a site is built
        from fl_lightning.runtime import ClientRuntime

        self.settings = settings
        os.environ.setdefault("WANDB_SILENT", "true")
        # A site logs nothing itself (the server's run directory holds the run's records).
        cli = build_cli([*run_args, *settings.args, "--trainer.logger=false"])
        cfg = cli.config_init["federation"]
        data_ids = list(cli.datamodule.client_ids)
        hosted = list(settings.clients) if settings.clients is not None else data_ids
        unknown = [c for c in hosted if c not in data_ids]
        if unknown:
            raise ValueError(f"node config {NODE_CLIENTS} names {unknown}, which its data do not hold ({data_ids})")
        self.clients = hosted
        seed = int(cli.config["seed_everything"])
        self.runtime = ClientRuntime(cli.model, cli.datamodule, cli.trainer, cfg, seed, client_ids=hosted)
        self.runtime.prepare()
        self.run_key: str | None = None

    # ------------------------------------------------------------------ what the server may know
    def describe(self) -> dict[str, Any]:
        """Metadata only: hosted client ids with their sample counts, and the data's shape (no sample, no label)."""
        data = self.runtime.data
        return {
            "clients": {c: [data.num_train_samples(c), data.num_test_samples(c)] for c in self.clients},
            "batch_size": int(data.batch_size),
            "num_classes": int(data.num_classes),
            "in_channels": int(data.in_channels),
            "image_size": [int(s) for s in data.image_size],
            "seed": int(data.seed),
        }

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
        self.runtime.start(self.run_dir())
        self._load_newest(round_index)

    def _files(self) -> dict[int, Path]:
        out = {}
        for path in self.run_dir().glob("round-*.flm"):
            m = _STATE_FILE.search(path.name)
            if m:
                out[int(m.group(1))] = path
        return out

    def _load_newest(self, up_to: int | None) -> int | None:
        files = {r: p for r, p in self._files().items() if up_to is None or r <= up_to}
        if not files:
            return None
        newest = max(files)
        self.runtime.load_state_dict(protocol.decode(files[newest].read_bytes()))
        return newest

    def save(self, round_index: int, keep_from: int | None = None) -> Path:
        """Write the runtime's state as the state of round ``round_index`` (atomically); prune what no resume needs.

        ``keep_from``: the oldest round the server may still resume from; older files go, except the newest of them.
        """
        path = self.run_dir() / f"round-{round_index:05d}.flm"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(protocol.encode(self.runtime.state_dict()))
        os.replace(tmp, path)
        if keep_from is not None and keep_from >= 0:
            older = sorted(r for r in self._files() if r <= keep_from)
            for r in older[:-1]:
                self._files()[r].unlink(missing_ok=True)
        return path

    def restore(self, round_index: int) -> int | None:
        """Resume the server's checkpoint of round ``round_index``: drop newer files, load the newest up to it."""
        for r, path in self._files().items():
            if r > round_index:
                path.unlink(missing_ok=True)
        return self._load_newest(round_index)

    # ------------------------------------------------------------------ tasks
    def handle(self, data: bytes, keep_from: int | None = None) -> bytes:
        """Answer an encoded task with an encoded reply; persist the state unless the task only reads."""
        task = protocol.decode(data)
        if not isinstance(task, Task):
            raise protocol.MessageError(f"expected a task, got {type(task).__name__}")
        if task.client_id not in self.clients:
            hosted = self.clients
            raise protocol.MessageError(f"client {task.client_id!r} is not hosted here (this node hosts {hosted})")
        reply = self.runtime.handle(task)
        if task.kind != protocol.EVALUATE:
            self.save(task.round, keep_from)
        return protocol.encode(reply)


_SITES: dict[tuple[Any, ...], Site] = {}


def site_for(flower_run: Any, run_args: list[str], settings: SiteSettings) -> Site:
    """The process's site of a Flower run (built on the first message the process sees)."""
    key = (flower_run, tuple(run_args), settings)
    if key not in _SITES:
        _SITES.clear()  # one run at a time per process: drop the previous run's module, data and Trainer
        _SITES[key] = Site(run_args, settings)
    return _SITES[key]
