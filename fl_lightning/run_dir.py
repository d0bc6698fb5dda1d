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


class RunDirectory:
    """Everything one run writes to disk.

    Args:
        output_dir: Parent directory.
        run_name: Directory name; default ``<YYYYmmdd-HHMMSS>-<suffix>``, with ``-2``, ``-3``… appended
            when it exists already, so a run never overwrites another.
        suffix: Appended to the generated name.

    """

    def __init__(self, output_dir: str | Path, run_name: str | None = None, suffix: str = "run") -> None:
        base = Path(output_dir)
        name = run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
        path, n = base / name, 1
        while run_name is None and path.exists():
            n += 1
            path = base / f"{name}-{n}"
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.client_rows: list[dict[str, Any]] = []
        self.round_rows: list[dict[str, Any]] = []

    @classmethod
    def reopen(cls, path: Path, client_rows: list[dict[str, Any]], round_rows: list[dict[str, Any]]) -> RunDirectory:
        """The directory of an interrupted run, with the rows it had recorded up to its checkpoint.

        Rows written after that checkpoint (by rounds that will now run again) are dropped.
        """
        run = cls.__new__(cls)
        run.path = Path(path)
        run.path.mkdir(parents=True, exist_ok=True)
        run.client_rows, run.round_rows = list(client_rows), list(round_rows)
        return run

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
