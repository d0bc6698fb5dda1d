"""``train.py --federation.workers=N``: this process becomes rank 0 and starts ranks 1 … N − 1 before any import.

Without this, the process that reads ``--federation.workers=N`` imports Lightning and builds the whole run only to
learn N, then spawns N fresh ranks that import and build everything again, one after the other on a busy machine.
:func:`start` reads N from the command line and the ``--config`` files alone (no torch, no Lightning imported yet),
starts the other ranks as copies of this very command (``sys.orig_argv``) with torchrun's variables, and makes
this process rank 0, so every rank imports in parallel with the others and the parent does no work twice.

When N cannot be told this early (``--federation`` given as a whole, ``--help``, ``--print_config``), nothing is
started and :func:`fl_lightning.cli.main` launches the ranks after parsing, as before. Rank 0 checks that the parsed
config asks for as many ranks as were started (:meth:`RankGroup.check_workers`).

A rank that dies or fails stops the run: a watcher thread per rank notices its exit, the other ranks are stopped,
rank 0's run raises :class:`~fl_lightning.errors.RankError` naming it (the gloo call waiting on that
rank fails at once); should rank 0 still be blocked in a call that does not return (joining the group while a rank
that never joined has died), the watcher ends the process after a grace period, saying why. Checkpoints are
written atomically, so the last complete one resumes either way.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from fl_lightning.errors import RankError

# How long the watcher lets rank 0 stop by itself once another rank has failed, before it ends the process.
GRACE_S = 10.0
# How long rank 0 waits, after the run, for the other ranks to leave the group and exit.
EXIT_WAIT_S = 60.0
_NO_PEEK = ("-h", "--help", "--print_config", "--federation", "--federation=")

_started: RankGroup | None = None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peek_workers(argv: Sequence[str]) -> int | None:
    """``federation.workers`` as the command line sets it, reading only ``--config`` files and overrides.

    Arguments apply in order, as in LightningCLI: a later ``--config`` or ``--federation.workers`` wins.

    Returns:
        The number of workers, 1 when nothing sets it, or ``None`` when it cannot be told without the parser.
    """
    workers = 1
    args = list(argv)
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in _NO_PEEK:
            return None
        if key not in ("--config", "--federation.workers"):
            continue
        if not eq:
            if i + 1 >= len(args):
                return None
            value = args[i + 1]
        if key == "--config":
            found = _workers_in_config(Path(value))
            if found is None:
                return None
            workers = found or workers
        else:
            try:
                workers = int(value)
            except ValueError:
                return None  # the parser will say what is wrong with it
    return workers


def _workers_in_config(path: Path) -> int | None:
    """``federation.workers`` in a config file: the number, 0 when the file does not set it, ``None`` if unreadable."""
    import yaml  # light (jsonargparse imports it anyway); only when there is a config file

    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None  # the parser reports the file
    if not isinstance(config, dict):
        return None
    federation = config.get("federation")
    if federation is None:
        return 0
    workers = federation.get("workers", 0) if isinstance(federation, dict) else None
    return workers if isinstance(workers, int) and not isinstance(workers, bool) else None


def start(argv: Sequence[str]) -> RankGroup | None:
    """Start ranks 1 … N − 1 of ``--federation.workers=N`` and make this process rank 0 (see the module docstring).

    Does nothing under torchrun or in a rank this started (``RANK`` is set), for N ≤ 1, or when N cannot be told
    yet. Call it before torch is imported: it sets ``OMP_NUM_THREADS`` to this rank's share of the CPU cores.

    Returns:
        The started ranks, also kept for :func:`started`; ``None`` if nothing was started.
    """
    global _started
    if "RANK" in os.environ:
        return None
    workers = peek_workers(argv)
    if workers is None or workers <= 1:
        return None
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // workers))
    common = {"WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": threads}  # fmt: skip
    children = {  # this very command (interpreter flags and script included), as rank 1 … N − 1
        rank: subprocess.Popen(
            [sys.executable, *sys.orig_argv[1:]],
            env={**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(1, workers)
    }
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    _started = RankGroup(children)
    return _started


def started() -> RankGroup | None:
    """The ranks :func:`start` started in this process, else ``None``."""
    return _started


class RankGroup:
    """Ranks 1 … N − 1 started by rank 0, each watched by a thread; rank 0 closes the group when its run ends."""

    def __init__(self, children: dict[int, subprocess.Popen]) -> None:
        """Watch ``children`` (rank → process)."""
        self.children = children
        self.failure: str | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()
        for rank, proc in children.items():
            threading.Thread(target=self._watch, args=(rank, proc), name=f"rank-{rank}-watcher", daemon=True).start()

    @property
    def world_size(self) -> int:
        """Number of ranks, rank 0 included."""
        return len(self.children) + 1

    def check_workers(self, workers: int) -> None:
        """Raise ``ValueError`` if the parsed ``federation.workers`` is not the number of ranks started."""
        if workers != self.world_size:
            raise ValueError(
                f"federation.workers: the command line read as {self.world_size} ranks before parsing, but the "
                f"parsed config says {workers}; set it once, with --federation.workers={workers}"
            )

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if code == 0 or self._closing.is_set():
            return
        with self._lock:
            if self.failure is not None:
                return
            self.failure = f"rank {rank} {describe_exit(code)}"
        self._stop_children()
        if not self._closing.wait(GRACE_S):  # rank 0 is blocked in a call that will not return: end it
            print(f"fl_lightning: {self.failure}; stopping rank 0", file=sys.stderr, flush=True)
            os._exit(1)

    def _stop_children(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.terminate()

    def close(self, ok: bool) -> None:
        """End the group: after a run that ended well, wait for the ranks' exits; else stop them.

        Raises:
            RankError: If a rank failed or did not exit in time (it is then stopped), naming it.
        """
        self._closing.set()
        if not ok:
            self._stop_children()
        error: str | None = None
        for rank, proc in self.children.items():
            try:
                code: int | None = proc.wait(EXIT_WAIT_S if ok and error is None else GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
            if ok and error is None and code != 0:
                error = f"rank {rank} " + (
                    f"did not exit within {EXIT_WAIT_S:.0f} s of the run's end" if code is None else describe_exit(code)
                )
                self._stop_children()  # the ranks still running are not waited for
        if error is not None:
            raise RankError(error)


def describe_exit(code: int) -> str:
    """``exited with code 1`` or ``died (SIGKILL)`` for a ``Popen.returncode``."""
    if code < 0:
        try:
            return f"died ({signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"exited with code {code}"
