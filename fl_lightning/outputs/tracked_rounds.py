"""The run's own record of what it sent to W&B per round, so a resume can send again what W&B lost.

A run killed with ``SIGKILL`` loses the end of its offline W&B transaction log (wandb-core writes it in 32 KiB
blocks): rounds that ``rounds.csv`` and the checkpoint count as done can be missing from every W&B part, and the
resume starts after them. Each round's logged call is therefore appended here too (``tracked_rounds.jsonl`` in
the run directory, one JSON line per ``log_round`` call, flushed to disk before the next round), and a resume
logs the lost rounds again from it, exactly as they were logged the first time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fl_lightning.outputs.run_dir import atomic_write_text

JOURNAL = "tracked_rounds.jsonl"


def append(run_dir: Path, round_idx: int, metrics: dict[str, Any], clients: Any) -> None:
    """Record one ``log_round`` call (the round, its metrics, its per-client table or None), durably."""
    line = json.dumps({"round": int(round_idx), "metrics": metrics, "clients": clients}, default=_plain) + "\n"
    with open(Path(run_dir) / JOURNAL, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())  # one small line per round; a checkpoint written next may count this round


def _plain(value: Any) -> Any:
    """A metric JSON cannot write as it is (a NumPy or 0-d tensor number) as a float; anything else as text."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def cut_back(run_dir: Path, done_rounds: int) -> list[dict[str, Any]]:
    """The recorded calls of rounds ``1..done_rounds``; the file is rewritten with exactly them.

    A killed run may have recorded rounds after its checkpoint; the resume runs them again, as ``rounds.csv`` is
    cut back. A last line cut off by the kill is dropped; a missing file reads as no calls.
    """
    path = Path(run_dir) / JOURNAL
    if not path.is_file():
        return []
    kept = [e for e in _entries(path.read_text(encoding="utf-8").splitlines()) if e["round"] <= done_rounds]
    atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in kept))
    return kept


def _entries(lines: Iterable[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # the line a kill cut off (only the last can be)
            continue
        if isinstance(entry, dict) and isinstance(entry.get("round"), int) and isinstance(entry.get("metrics"), dict):
            out.append(entry)
    return out


def rounds_to_log_again(logged: Iterable[int], done_rounds: int) -> list[int]:
    """The rounds a resume logs again: from the first of ``1..done_rounds`` that no W&B part holds, to the last.

    From the first gap on, not only the gaps: the upload (:mod:`fl_lightning.tools.wandb_sync`) leaves out of every
    earlier part the rounds a later part logs, so the history stays in order with each round once.
    """
    have = set(logged)
    first = next((r for r in range(1, done_rounds + 1) if r not in have), None)
    return [] if first is None else list(range(first, done_rounds + 1))
