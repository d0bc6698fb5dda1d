"""The run directory: resolved config, metrics.csv, rounds.csv and summary.json, written atomically."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from fl_lightning.checkpoint import remove_orphan_temps

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so readers never see half a file.

    Args:
        path: Destination.
        text: Content.
        durable: fsync before the rename (survives a power loss). The per-round CSVs skip it: they are
            rewritten every round and rebuilt from the checkpoint's rows on resume.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_safe(value: Any) -> Any:
    """``value`` with NaN/inf floats replaced by None, recursively (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _csv_text(rows: list[dict[str, Any]]) -> str:
    """Rows as CSV; the header is the union of keys in first-seen order."""
    header: dict[str, None] = {}
    for row in rows:
        header.update(dict.fromkeys(row))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(header), restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


LOCK_NAME = ".lock"
RESUME_RECORD = "resume_changes.json"

# Run directories this process holds: resolved path -> open lock file. A process may reopen what it holds (a
# Federation resumed from Python after another finished in the same process); other processes may not.
_HELD: dict[Path, Any] = {}


class RunDirectoryInUse(RuntimeError):
    """Another live process holds the run directory."""


def claim(path: Path) -> None:
    """Hold ``path`` for this process with an exclusive lock on ``path/.lock`` (released when the process ends).

    ``flock`` locks die with their process, so a run killed with SIGKILL leaves no stale lock behind. Where
    ``fcntl`` does not exist (Windows) only the atomic creation of new run directories protects them.

    Raises:
        RunDirectoryInUse: If another process holds it, naming that process.
    """
    key = path.resolve()
    if key in _HELD or fcntl is None:
        return
    handle = open(path / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the life of the process
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunDirectoryInUse(
            f"run directory {path} is in use by another process (pid {holder}); two runs writing one directory "
            "would mix their checkpoints and records"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    _HELD[key] = handle


def release(path: Path) -> None:
    """Give up this process's hold on ``path`` (no-op if it holds none)."""
    handle = _HELD.pop(Path(path).resolve(), None)
    if handle is not None:
        handle.close()  # closing the file releases the flock


class RunDirectory:
    """Everything one run writes to disk; the directory is this run's alone.

    A new run creates its directory atomically (``mkdir`` fails if it exists) and locks it, so neither a later
    nor a concurrent run with the same ``run_name`` can write into it: an existing run is only continued with
    ``federation.resume`` (:meth:`reopen`).

    Args:
        output_dir: Parent directory.
        run_name: Directory name; default ``<YYYYmmdd-HHMMSS>-<suffix>``, with ``-2``, ``-3``… appended
            when it exists already, so a run never overwrites another.
        suffix: Appended to the generated name.

    Raises:
        FileExistsError: If ``run_name`` names an existing directory.

    """

    def __init__(self, output_dir: str | Path, run_name: str | None = None, suffix: str = "run") -> None:
        base = Path(output_dir)
        base.mkdir(parents=True, exist_ok=True)
        name = run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
        path, n = base / name, 1
        while True:
            try:
                path.mkdir()  # atomic: of two runs creating the same directory, exactly one succeeds
                break
            except FileExistsError:
                if run_name is not None:
                    raise FileExistsError(
                        f"run directory {path} exists already (federation.run_name={run_name!r}): continue that run "
                        "with --federation.resume=last, or choose another run_name"
                    ) from None
                n += 1
                path = base / f"{name}-{n}"
        claim(path)
        self.path = path
        self.client_rows: list[dict[str, Any]] = []
        self.round_rows: list[dict[str, Any]] = []

    @classmethod
    def reopen(cls, path: Path, client_rows: list[dict[str, Any]], round_rows: list[dict[str, Any]]) -> RunDirectory:
        """The directory of an interrupted run, with the rows it had recorded up to its checkpoint.

        Rows written after that checkpoint (by rounds that will now run again) are dropped. The directory is
        locked first; then the temporary files a killed run left are removed.

        Raises:
            FileNotFoundError: If ``path`` is not a directory.
            RunDirectoryInUse: If another process holds it.
        """
        run = cls.__new__(cls)
        run.path = Path(path)
        if not run.path.is_dir():
            raise FileNotFoundError(f"run directory to resume not found: {run.path}")
        claim(run.path)
        remove_orphan_temps(run.path)
        run.client_rows, run.round_rows = list(client_rows), list(round_rows)
        return run

    def close(self) -> None:
        """Release the directory (at the end of the run; the end of the process releases it too)."""
        release(self.path)

    def record_resume(self, checkpoint: Path, round_idx: int, changes: dict[str, tuple[Any, Any]]) -> None:
        """Append this resume and the allowed config changes it made to ``resume_changes.json``.

        Args:
            checkpoint: The checkpoint resumed from.
            round_idx: Rounds completed in it.
            changes: ``{dotted key: (saved, new)}`` from :func:`fl_lightning.resume.check_resume_config`.
        """
        path = self.path / RESUME_RECORD
        history = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
        history.append(
            {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "checkpoint": str(checkpoint),
                "after_round": int(round_idx),
                "changes": {key: {"saved": old, "now": new} for key, (old, new) in changes.items()},
            }
        )
        atomic_write_text(path, json.dumps(json_safe(history), indent=2, default=str, allow_nan=False) + "\n")

    def write_json(self, name: str, content: dict[str, Any]) -> None:
        """Any JSON record of the run (e.g. ``environment.json``)."""
        text = json.dumps(json_safe(content), indent=2, sort_keys=True, default=str, allow_nan=False)
        atomic_write_text(self.path / name, text + "\n")

    def write_config(self, text: str) -> None:
        """The resolved config (YAML) that reproduces the run."""
        atomic_write_text(self.path / "config.yaml", text)

    def add_rows(self, client_rows: list[dict[str, Any]], round_row: dict[str, Any]) -> None:
        """Append one round's rows and rewrite ``metrics.csv`` (per round and client) and ``rounds.csv``."""
        self.client_rows.extend(client_rows)
        self.round_rows.append(round_row)
        atomic_write_text(self.path / "metrics.csv", _csv_text(self.client_rows), durable=False)
        atomic_write_text(self.path / "rounds.csv", _csv_text(self.round_rows), durable=False)

    def rewrite_rounds(self) -> None:
        """Rewrite ``rounds.csv`` after entries were added to a recorded round row."""
        atomic_write_text(self.path / "rounds.csv", _csv_text(self.round_rows), durable=False)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """The final evaluation table as ``summary.json``."""
        self.write_json("summary.json", summary)
