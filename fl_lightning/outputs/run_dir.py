"""The run directory: resolved config, metrics.csv, rounds.csv and summary.json, written atomically."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from datamodules.files import new_file_mode
from fl_lightning.outputs.checkpoint import list_checkpoints, remove_orphan_temps

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
            fsynced before each checkpoint (:meth:`RunDirectory.sync`) and cut back to its row counts on resume.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, new_file_mode())  # one rule for every file of a run directory (see new_file_mode)
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


def _extend_header(header: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """``header`` followed by the keys of ``rows`` it lacks, in first-seen order (the union of all keys)."""
    seen = dict.fromkeys(header)
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def _csv_lines(rows: list[dict[str, Any]], header: list[str], with_header: bool) -> str:
    """``rows`` as CSV lines under ``header`` (absent keys empty), with the header line first if asked."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=header, restval="", lineterminator="\n")
    if with_header:
        writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _csv_text(rows: list[dict[str, Any]]) -> str:
    """Rows as CSV; the header is the union of keys in first-seen order."""
    return _csv_lines(rows, _extend_header([], rows), with_header=True)


def write_json(path: Path, content: dict[str, Any]) -> None:
    """A JSON record of a run (sorted keys, NaN as null), written atomically."""
    text = json.dumps(json_safe(content), indent=2, sort_keys=True, default=str, allow_nan=False)
    atomic_write_text(path, text + "\n")


# Columns of metrics.csv / rounds.csv that hold text (everything else holds numbers).
TEXT_COLUMNS = frozenset({"client"})
_INT = re.compile(r"-?\d+")


def parse_cell(column: str, text: str) -> Any:
    """A CSV cell back as the value that was written: int, float (``repr`` round-trips exactly) or text.

    Only the columns of :data:`TEXT_COLUMNS` (client ids such as ``"7"``) stay text whatever they look like.
    """
    if column in TEXT_COLUMNS:
        return text
    if _INT.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return {"True": True, "False": False}.get(text, text)


def read_rows(path: Path, count: int) -> list[dict[str, Any]]:
    """The first ``count`` rows of a CSV written by :class:`RunDirectory`, typed; empty cells are absent keys.

    Raises:
        ValueError: If the file holds fewer than ``count`` complete rows, naming it.
    """
    rows: list[dict[str, Any]] = []
    if count:
        if not path.is_file():
            raise ValueError(f"{path} is missing: the checkpoint counts {count} rows in it")
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            for cells in reader:
                if len(rows) == count:
                    break
                if len(cells) != len(header):  # a row cut short by a kill is never among the counted ones
                    break
                rows.append({k: parse_cell(k, v) for k, v in zip(header, cells) if v != ""})
    if len(rows) < count:
        raise ValueError(
            f"{path} holds {len(rows)} complete rows but the checkpoint counts {count}: the run directory's records "
            "were changed or truncated after the checkpoint was written"
        )
    return rows


METRICS_CSV = "metrics.csv"
ROUNDS_CSV = "rounds.csv"
LOCK_NAME = ".lock"
RESUME_RECORD = "resume_changes.json"

# Run directories this process holds: resolved path -> open lock file. A process may reopen what it holds (a
# Federation resumed from Python after another finished in the same process); other processes may not.
_HELD: dict[Path, Any] = {}
_CREATING = threading.Lock()  # one thread at a time creates and claims (claims within a process are reentrant)


class RunDirectoryInUse(RuntimeError):
    """Another live process holds the run directory."""


def claim(path: Path) -> bool:
    """Hold ``path`` for this process with an exclusive lock on ``path/.lock`` (released when the process ends).

    ``flock`` locks die with their process, so a run killed with SIGKILL leaves no stale lock behind. Where
    ``fcntl`` does not exist (Windows) only the atomic creation of new run directories protects them.

    Returns:
        Whether this call took the hold (False: this process held it already, or there is no ``fcntl``).

    Raises:
        RunDirectoryInUse: If another process holds it, naming that process.
    """
    key = path.resolve()
    if key in _HELD or fcntl is None:
        return False
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
    return True


def _refuse_other_folders(path: Path, run_name: str) -> None:
    """Raise ``FileExistsError`` if ``path`` holds files but was never a run's (no :data:`LOCK_NAME`, our marker).

    Every run writes its lock file first, so a run stopped before its first checkpoint carries it; a folder of
    the user's (data, results of another tool) never does, and nothing in it is moved or written.
    """
    if (path / LOCK_NAME).exists() or not any(path.iterdir()):
        return
    raise FileExistsError(
        f"{path} exists and is not a run directory (federation.run_name={run_name!r}; it has no {LOCK_NAME}, which "
        "every run writes first): nothing in it was touched. Choose another run_name or output_dir"
    )


def _set_aside(path: Path) -> None:
    """Move what a run stopped before its first checkpoint wrote into ``path`` to a sibling directory (path held)."""
    entries = [e for e in path.iterdir() if e.name != LOCK_NAME]
    if not entries:
        warnings.warn(f"run directory {path} exists but is empty and unused: starting the run in it", stacklevel=3)
        return
    aside = path.with_name(f"{path.name}.stopped-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.stopped-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
    aside.mkdir()
    for entry in entries:
        entry.rename(aside / entry.name)
    warnings.warn(
        f"run directory {path} holds no round checkpoint and no live run (a run stopped before its first "
        f"checkpoint): starting afresh in it; what it held was moved to {aside}",
        stacklevel=3,
    )


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

    A ``run_name`` whose directory exists but holds no round checkpoint and no live process (a run stopped before
    its first checkpoint) starts afresh there, with a warning; what the stopped run had written is moved to
    ``<run_name>.stopped-<time>`` beside it. Only a directory that carries a run's lock file is treated so: any
    other folder that holds files is refused, untouched.

    Raises:
        FileExistsError: If ``run_name`` names an existing directory with round checkpoints, or a folder with files
            that is not a run directory.
        RunDirectoryInUse: If ``run_name`` names a directory a live process holds.

    """

    def __init__(self, output_dir: str | Path, run_name: str | None = None, suffix: str = "run") -> None:
        base = Path(output_dir)
        base.mkdir(parents=True, exist_ok=True)
        name = run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
        path, n = base / name, 1
        with _CREATING:
            while True:
                try:
                    path.mkdir()  # atomic: of two runs creating the same directory, exactly one succeeds
                    break
                except FileExistsError:
                    if run_name is not None:
                        if path.is_dir() and not list_checkpoints(path) and path.resolve() not in _HELD:
                            _refuse_other_folders(path, run_name)
                            claim(path)  # refused if a live run of another process holds it
                            _set_aside(path)
                            break
                        raise FileExistsError(
                            f"run directory {path} exists already (federation.run_name={run_name!r}): continue that "
                            "run with --federation.resume=last, or choose another run_name"
                        ) from None
                    n += 1
                    path = base / f"{name}-{n}"
            claim(path)
        self.path = path
        self.client_rows: list[dict[str, Any]] = []
        self.round_rows: list[dict[str, Any]] = []
        self._headers: dict[str, list[str]] = {}  # per CSV: the header it holds on disk

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
        run._headers = {}  # the next rows rewrite both files from these rows
        return run

    @classmethod
    def resume(cls, path: Path, row_counts: dict[str, int]) -> RunDirectory:
        """The directory of an interrupted run, its records cut back to the checkpoint's row counts.

        The CSVs are the source of the rows (a checkpoint stores only their counts): the first ``row_counts``
        rows of ``metrics.csv`` and ``rounds.csv`` are read back and both files are rewritten with exactly them
        (atomically and durably), dropping what rounds after the checkpoint had appended. The directory is locked
        first; then the temporary files a killed run left are removed.

        Args:
            path: The run directory.
            row_counts: ``{"clients": rows of metrics.csv, "rounds": rows of rounds.csv}`` as the checkpoint
                saved them.

        Raises:
            FileNotFoundError: If ``path`` is not a directory.
            RunDirectoryInUse: If another process holds it.
            ValueError: If a CSV holds fewer rows than the checkpoint counts.
        """
        run = cls.reopen(path, [], [])
        run.client_rows = read_rows(run.path / METRICS_CSV, int(row_counts["clients"]))
        run.round_rows = read_rows(run.path / ROUNDS_CSV, int(row_counts["rounds"]))
        for name, rows in ((METRICS_CSV, run.client_rows), (ROUNDS_CSV, run.round_rows)):
            run._headers[name] = _extend_header([], rows)
            atomic_write_text(run.path / name, _csv_lines(rows, run._headers[name], with_header=True))
        return run

    def close(self) -> None:
        """Release the directory (at the end of the run; the end of the process releases it too)."""
        release(self.path)

    def record_resume(self, checkpoint: Path, round_idx: int, changes: dict[str, tuple[Any, Any]]) -> None:
        """Append this resume and the allowed config changes it made to ``resume_changes.json``.

        Args:
            checkpoint: The checkpoint resumed from.
            round_idx: Rounds completed in it.
            changes: ``{dotted key: (saved, new)}`` from :func:`fl_lightning.outputs.resume.check_resume_config`.
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
        write_json(self.path / name, content)

    def write_config(self, text: str) -> None:
        """The resolved config (YAML) that reproduces the run."""
        atomic_write_text(self.path / "config.yaml", text)

    def add_rows(self, client_rows: list[dict[str, Any]], round_row: dict[str, Any]) -> None:
        """Record one round's rows in ``metrics.csv`` (per round and client) and ``rounds.csv``.

        The rows are appended to the files, so a round costs in proportion to its own rows, not to the history;
        only a row with a column the file lacks yet (e.g. the first evaluation's metrics) rewrites the file
        (atomically), under the extended header. The content is the same either way: the header is the union of
        the keys in first-seen order. Appends are not fsynced; :meth:`sync` makes them durable before a checkpoint
        counts them.
        """
        self.client_rows.extend(client_rows)
        self.round_rows.append(round_row)
        self._record(METRICS_CSV, self.client_rows, client_rows)
        self._record(ROUNDS_CSV, self.round_rows, [round_row])

    def _record(self, name: str, rows: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
        path = self.path / name
        header = self._headers.get(name)
        if header is not None and path.is_file() and all(k in header for row in new for k in row):
            with open(path, "a", encoding="utf-8", newline="") as f:
                f.write(_csv_lines(new, header, with_header=False))
            return
        self._headers[name] = _extend_header(header or [], rows if header is None else new)
        atomic_write_text(path, _csv_lines(rows, self._headers[name], with_header=True), durable=False)

    def rewrite_rounds(self) -> None:
        """Rewrite ``rounds.csv`` after entries were added to a recorded round row (one row per round: small)."""
        self._headers[ROUNDS_CSV] = _extend_header(self._headers.get(ROUNDS_CSV, []), self.round_rows[-1:])
        text = _csv_lines(self.round_rows, self._headers[ROUNDS_CSV], with_header=True)
        atomic_write_text(self.path / ROUNDS_CSV, text, durable=False)

    def sync(self) -> None:
        """Flush the CSVs to disk (fsync), so that a checkpoint written next never counts rows a crash could lose."""
        for name in (METRICS_CSV, ROUNDS_CSV):
            path = self.path / name
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """The final evaluation table as ``summary.json``."""
        self.write_json("summary.json", summary)
