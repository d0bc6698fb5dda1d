"""Which worker owns a running trial, and whether it is still alive.

A worker writes who it is into the trial it runs (Optuna user attributes): host, boot, process id and the process's
start time, and a heartbeat every :data:`HEARTBEAT` seconds. A restarted sweep decides from them which ``RUNNING``
trials are orphans to continue: on this machine, a trial whose process is gone (or whose process id now belongs to
another process, told apart by its start time); a trial of another machine once its heartbeat is older than the
grace period (the machines' clocks are assumed to agree within it).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Seconds between two heartbeats of a running trial.
HEARTBEAT = 30.0
#: Seconds after its last heartbeat that another machine's trial counts as orphaned.
GRACE = 300.0
PREFIX = "fl_lightning:"  # the user attributes the sweep writes into a trial


@dataclass(frozen=True)
class Owner:
    """A worker process, as a trial records it.

    Attributes:
        host: The machine's name.
        boot: The machine's boot id (Linux), so a process of before a reboot is never taken for a live one.
        pid: The process id.
        started: The process's start time (clock ticks since boot on Linux), so a reused pid is told apart.
    """

    host: str
    boot: str
    pid: int
    started: str

    def attrs(self) -> dict[str, Any]:
        """The trial's user attributes for this owner (the heartbeat is written separately)."""
        return {f"{PREFIX}host": self.host, f"{PREFIX}boot": self.boot, f"{PREFIX}pid": self.pid,
                f"{PREFIX}started": self.started}  # fmt: skip

    @classmethod
    def of(cls, attrs: Mapping[str, Any]) -> Owner | None:
        """The owner recorded in a trial's user attributes, or None if the sweep never recorded one."""
        if f"{PREFIX}pid" not in attrs:
            return None
        return cls(str(attrs.get(f"{PREFIX}host", "")), str(attrs.get(f"{PREFIX}boot", "")),
                   int(attrs[f"{PREFIX}pid"]), str(attrs.get(f"{PREFIX}started", "")))  # fmt: skip


def _boot_id() -> str:
    path = Path("/proc/sys/kernel/random/boot_id")
    return path.read_text().strip() if path.exists() else ""


def process_start(pid: int) -> str | None:
    """A process's start time as the kernel states it, "" where it cannot be read, None when there is no process."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():
        try:
            text = stat.read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None
        # the name (field 2) is in parentheses and may hold spaces: fields after the last ')' are fixed
        fields = text.rsplit(")", 1)[1].split()
        return "zombie" if fields[0] == "Z" else fields[19]  # field 22, the start time
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return ""
    return ""


def this_process() -> Owner:
    """The owner record of the calling process."""
    pid = os.getpid()
    return Owner(socket.gethostname(), _boot_id(), pid, process_start(pid) or "")


def is_alive(owner: Owner, attrs: Mapping[str, Any], now: float, here: Owner | None = None) -> bool:
    """Whether the process that owns a trial may still be running it.

    Args:
        owner: The trial's recorded owner.
        attrs: The trial's user attributes (for the heartbeat).
        now: The current time (``time.time()``).
        here: This machine's owner record (default: :func:`this_process`).
    """
    here = here or this_process()
    if owner.host == here.host and owner.boot == here.boot:
        started = process_start(owner.pid)
        return started is not None and started != "zombie" and (not owner.started or started == owner.started)
    if owner.host == here.host:
        return False  # this machine rebooted since
    beat = attrs.get(f"{PREFIX}heartbeat")
    return beat is not None and now - float(beat) < GRACE


class Heartbeat:
    """A daemon thread that calls ``beat()`` every :data:`HEARTBEAT` seconds until stopped (a context manager)."""

    def __init__(self, beat: Callable[[], None], every: float = HEARTBEAT) -> None:
        self.beat, self.every = beat, every
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sweep-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                self.beat()
            except Exception:  # a database hiccup: the next beat tries again; a trial is not failed for it
                pass

    def __enter__(self) -> Heartbeat:
        self.beat()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()
