"""``--federation.workers=N``: this process becomes rank 0 of N ranks on this machine and starts ranks 1 … N − 1.

The one launcher of local ranks. :class:`~fl_lightning.cli.FederatedCLI` calls :func:`start` once the config is
parsed and before anything is instantiated, so ``federation.workers`` is read from the parsed config (a YAML file,
``--federation.workers 2`` or ``--federation.workers=2``) and this process does no work twice: it builds its own
rank (rank 0) while the other ranks, started as new processes with torchrun's variables, import and build theirs.
Under ``torchrun`` (``RANK`` set) nothing is started.

A rank that dies or fails stops the run: a watcher thread per rank notices its exit, the other ranks are stopped,
rank 0's run raises :class:`~fl_lightning.errors.RankError` naming it (the gloo call waiting on that
rank fails at once); should rank 0 still be blocked in a call that does not return (joining the group while a rank
that never joined has died), the watcher ends the process after a grace period, saying why. Checkpoints are
written atomically, so the last complete one resumes either way. When the run ends, :meth:`RankGroup.close`
gives this process back the environment and thread count it had (a program that calls ``main()`` twice, a test).
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

import torch

from fl_lightning.errors import RankError

# How long the watcher lets rank 0 stop by itself once another rank has failed, before it ends the process.
GRACE_S = 10.0
# How long rank 0 waits, after the run, for the other ranks to leave the group and exit.
EXIT_WAIT_S = 60.0
#: What a started rank runs: what train.py runs (its imports kept out of the cyclic collector's way, see heap.py),
#: with the same arguments; the marker names it in ``ps``.
RANK_CODE = (
    "import sys\nfrom fl_lightning.startup.heap import long_lived\nwith long_lived():\n"
    "    from fl_lightning.cli import main\nmain(sys.argv[1:])  # fl_lightning local rank"
)
#: The folder that holds the ``fl_lightning`` package this process imported.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
#: torchrun's variables, as a started rank gets them.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(argv: Sequence[str], workers: int) -> RankGroup:
    """Start ranks 1 … ``workers`` − 1 running ``main(argv)`` and make this process rank 0.

    Each rank gets torchrun's variables and, unless ``OMP_NUM_THREADS`` says otherwise, an equal share of the CPU
    cores as intra-op threads (this process too, through ``torch.set_num_threads``).

    Args:
        argv: The run's arguments (what ``main`` was given); relative paths resolve in this working directory.
        workers: The number of ranks, rank 0 included (> 1).

    Returns:
        The started ranks; :meth:`RankGroup.close` ends them and restores this process.
    """
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // workers))
    common = {"WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port())}  # fmt: skip
    # The folder holding fl_lightning (and callbacks/, datamodules/ of a checkout) first on the ranks' path: they
    # import what this process imported, also when it ran a checkout's train.py from elsewhere without installing.
    path = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    own = {"OMP_NUM_THREADS": threads, "PYTHONPATH": path}
    children = {
        rank: subprocess.Popen(
            [sys.executable, "-c", RANK_CODE, *argv],
            env={**os.environ, **common, **own, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(1, workers)
    }
    group = RankGroup(children, saved_env={k: os.environ.get(k) for k in RANK_VARS}, threads=torch.get_num_threads())
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    torch.set_num_threads(int(threads))
    return group


class RankGroup:
    """Ranks 1 … N − 1 started by rank 0, each watched by a thread; rank 0 closes the group when its run ends."""

    def __init__(
        self, children: dict[int, subprocess.Popen], saved_env: dict[str, str | None] | None = None, threads: int = 0
    ) -> None:
        """Watch ``children`` (rank → process); ``saved_env`` and ``threads``: what :meth:`close` restores."""
        self.children = children
        self.saved_env, self.threads = saved_env or {}, threads
        self.failure: str | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()
        for rank, proc in children.items():
            threading.Thread(target=self._watch, args=(rank, proc), name=f"rank-{rank}-watcher", daemon=True).start()

    @property
    def world_size(self) -> int:
        """Number of ranks, rank 0 included."""
        return len(self.children) + 1

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
        self._restore()
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

    def _restore(self) -> None:
        """Give this process back the rank variables and thread count it had before :func:`start`."""
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.threads:
            torch.set_num_threads(self.threads)


def describe_exit(code: int) -> str:
    """``exited with code 1`` or ``died (SIGKILL)`` for a ``Popen.returncode``."""
    if code < 0:
        try:
            return f"died ({signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"exited with code {code}"
