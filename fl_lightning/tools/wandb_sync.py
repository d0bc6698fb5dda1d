"""Upload a resumed offline W&B run as one W&B run, one history: ``python -m fl_lightning.tools.wandb_sync RUN_DIR``.

W&B cannot reopen an offline run: each start of a run (the first one and every resume) writes its own
``wandb/offline-run-<time>-<id>`` directory with the same run id (the transaction log is opened with ``O_EXCL``,
wandb-core ``transactionlog.OpenWriter``). What ``wandb sync`` (wandb 0.31, wandb-core's ``runsync``) does with them:

- Files of one run (entity/project/id) given to one ``wandb sync`` are synced one after another in the order of
  their run record's start time (``RunSyncOperation.initAndPlan``); separate ``wandb sync`` calls keep no order.
- A part whose run record says ``resume`` (the SDK records ``resume="allow"|"must"`` even offline,
  ``interface._make_run``) resumes the run on the server at upload: its history is appended after the rows already
  there and its ``_step`` numbers, which start at 0 in every offline part, are reassigned to follow them. A part
  without it is upserted into the existing run: its rows are appended too (at the server's history line count) but
  keep the ``_step`` numbers of its file, repeating steps the run has. So the parts must go up in order: syncing
  only the newest directory (what W&B's own end-of-run hint names) makes a run of the rounds after the checkpoint,
  and the first part synced after it lands behind it with steps 0, 1, ... again. (Checked against a recording fake
  backend, ``tests/fl_lightning/test_wandb_resume.py``; older wandb wrote such a part over the history from line 0,
  wandb issues #3841, #5865.)
- Rounds that a killed run logged after its last checkpoint are run again by the resume, so the earlier part holds
  rows that the later part logs again (``rounds.csv`` was cut back to the checkpoint; W&B is not): with ``_step``
  reassigned, nothing is dropped, and the chart would show those rounds twice.

- A run killed with ``SIGKILL`` loses the end of its part (wandb-core writes the file in 32 KiB blocks), possibly
  rounds the checkpoint counts as done; the resume then starts after them. The round tracker logs them again into
  the resumed part from the run's own record (:mod:`fl_lightning.outputs.tracked_rounds`), and this helper leaves
  them out of the earlier part like any round a later part logs.

This helper finds the parts (the run directory's ``wandb/`` folder and :data:`RECORD`, which the round tracker
writes for each offline part, also one outside the run directory), checks they are one run, and uploads them in
order with one ``wandb sync`` each. A part holding rounds that a later part logs again is uploaded from a copy
without those rows (``wandb/fl_lightning-trimmed/<part>``; the original stays as W&B wrote it). Before
uploading it reports, by round, what the resulting history would get wrong against ``rounds.csv``: gaps, rounds
twice, rounds that ``rounds.csv`` does not hold. ``--dry-run`` prints the plan, that report and the commands
without running anything.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Written into the run directory by fl_lightning.outputs.tracking: one entry per offline W&B part of the run.
RECORD = "wandb_offline_parts.json"
TRIMMED = "fl_lightning-trimmed"  # under the wandb folder: one level too deep for a plain `wandb sync <wandb dir>`
COMMAND = "python -m fl_lightning.tools.wandb_sync"

# W&B's transaction log (wandb-core leveldb.NewWriterExt with CRCAlgoIEEE): a 7-byte header, then LevelDB-log
# chunks in 32 KiB blocks, each with a CRC-32 (IEEE) of its type byte and payload, its length and its type.
_HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
_BLOCK = 32768
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class SyncRefused(ValueError):
    """The parts cannot be uploaded as one run (missing, of other runs, or not recorded as resumed)."""


# ------------------------------------------------------------------------------------------------ transaction log


def read_payloads(path: Path) -> Iterator[bytes]:
    """The serialized records of a ``.wandb`` file, in order; a killed run's unfinished last record is left out.

    Raises:
        SyncRefused: If the file is not a W&B transaction log.
    """
    data = Path(path).read_bytes()
    if data[: len(_HEADER)] != _HEADER:
        raise SyncRefused(f"{path} is not a W&B transaction log (wrong header)")
    pos, pending = len(_HEADER), b""
    while pos + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER:  # the block's trailer padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if kind == 0 and length == 0:  # zeros: the end of what was written
            return
        payload = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        if len(payload) < length:  # cut off mid-chunk by a kill
            return
        pos += _CHUNK_HEADER + length
        pending = payload if kind in (_FULL, _FIRST) else pending + payload
        if kind in (_FULL, _LAST):
            yield pending


def write_payloads(path: Path, payloads: Iterable[bytes]) -> None:
    """Write serialized records as a ``.wandb`` file that wandb-core reads (the inverse of :func:`read_payloads`)."""
    out = bytearray(_HEADER)
    for payload in payloads:
        first = True
        while True:
            left_in_block = _BLOCK - len(out) % _BLOCK
            if left_in_block < _CHUNK_HEADER:
                out += b"\0" * left_in_block
                continue
            fragment, payload = payload[: left_in_block - _CHUNK_HEADER], payload[left_in_block - _CHUNK_HEADER :]
            last = not payload
            kind = (_FULL if last else _FIRST) if first else (_LAST if last else _MIDDLE)
            crc = zlib.crc32(fragment, zlib.crc32(bytes([kind])))
            out += struct.pack("<IHB", crc, len(fragment), kind) + fragment
            first = False
            if last:
                break
    path.write_bytes(bytes(out))


def read_records(path: Path) -> list[Any]:
    """The protobuf records (``wandb_internal_pb2.Record``) of a ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb  # the helper's only wandb import, once it reads a file

    records = []
    for payload in read_payloads(path):
        record = pb.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def history_round(record: Any) -> int | None:
    """The ``round`` a history record logged (the tracker logs it with every round-level row), or None."""
    if record.WhichOneof("record_type") != "history":
        return None
    for item in record.history.item:
        if (item.key or "/".join(item.nested_key)) == "round":
            return int(float(json.loads(item.value_json)))
    return None


# ------------------------------------------------------------------------------------------------ the parts


@dataclass
class Part:
    """One offline W&B directory of the run (one start of it).

    Attributes:
        file: Its ``run-<id>.wandb`` transaction log.
        run_id: The W&B run id in its run record.
        entity: The entity in its run record ("" for the user's default).
        project: The project in its run record.
        start_time: When this start began (seconds since the epoch; W&B orders same-run files by it).
        resume: Whether its run record asks the upload to resume the run (true for every start after the first).
        rounds: The rounds of its history rows, in order.
    """

    file: Path
    run_id: str
    entity: str
    project: str
    start_time: float
    resume: bool
    rounds: list[int] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        """Its ``offline-run-<time>-<id>`` directory."""
        return self.file.parent

    @property
    def trimmed_file(self) -> Path:
        """Where the copy without superseded rows goes (the parent must be named ``offline-*`` for ``wandb sync``)."""
        return self.dir.parent / TRIMMED / self.dir.name / self.file.name


def load_part(file: Path) -> Part | None:
    """The part written to ``file``, or None when it holds no run record (a start killed before W&B began it)."""
    records = read_records(file)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    if not runs:
        return None
    run = runs[0]
    return Part(
        file=file,
        run_id=run.run_id,
        entity=run.entity,
        project=run.project,
        start_time=run.start_time.ToMicroseconds() / 1e6,
        resume=getattr(run, "resume", False),  # the field exists from wandb 0.31 (checked in plan())
        rounds=[r for r in map(history_round, records) if r is not None],
    )


def record_part(run_dir: Path, file: Path, run_id: str) -> None:
    """Add an offline W&B part to the run directory's :data:`RECORD` (relative when inside it: runs get moved)."""
    from fl_lightning.outputs.run_dir import atomic_write_text

    path = Path(run_dir) / RECORD
    parts = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    file = Path(file).resolve()
    try:
        where = str(file.relative_to(Path(run_dir).resolve()))
    except ValueError:
        where = str(file)
    if where not in [p["file"] for p in parts]:
        parts.append({"file": where, "run_id": run_id})
        atomic_write_text(path, json.dumps(parts, indent=2) + "\n")


def find_parts(run_dir: Path) -> tuple[list[Part], list[str]]:
    """The run's offline W&B parts in upload order, and notes on files left out.

    Args:
        run_dir: The run directory (``<output_dir>/<run_name>``), or a W&B folder holding ``offline-run-*``.

    Returns:
        The parts sorted by start time (W&B's own order for files of one run), and notes.

    Raises:
        SyncRefused: If a recorded part is missing, none is found, or the parts belong to different W&B runs.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SyncRefused(f"{run_dir} is not a directory")
    files: dict[Path, Path] = {}
    record = run_dir / RECORD
    if record.is_file():
        for entry in json.loads(record.read_text(encoding="utf-8")):
            file = run_dir / entry["file"]
            if not file.is_file():
                raise SyncRefused(
                    f"part {entry['file']} of W&B run {entry['run_id']} (listed in {record}) is missing: uploading "
                    "the other parts without it would leave a gap or put a later part first; restore it and run again"
                )
            files[file.resolve()] = file
    for wandb_dir in (run_dir / "wandb", run_dir):
        for file in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
            files.setdefault(file.resolve(), file)
    if not files:
        raise SyncRefused(f"no offline W&B run in {run_dir} (looked for wandb/offline-run-*/run-*.wandb and {RECORD})")
    parts, notes = [], []
    for file in files.values():
        part = load_part(file)
        if part is None:
            notes.append(f"{file.parent}: no run record (a start killed before W&B began it): nothing to upload")
        else:
            parts.append(part)
    ids = {(p.entity, p.project, p.run_id) for p in parts}
    if len(ids) > 1:
        listed = "; ".join(f"{p.dir} -> {'/'.join(x for x in (p.entity, p.project, p.run_id) if x)}" for p in parts)
        raise SyncRefused(f"the offline W&B directories of {run_dir} belong to different W&B runs: {listed}")
    if not parts:
        raise SyncRefused(f"no offline W&B part of {run_dir} holds a run record")
    parts.sort(key=lambda p: (p.start_time, p.dir.name))
    return parts, notes


def logged_rounds(run_dir: Path) -> set[int]:
    """The rounds some offline W&B part of the run holds a history row of (none when it has no part yet).

    Raises:
        SyncRefused: If the parts cannot be read as one run (see :func:`find_parts`).
    """
    run_dir = Path(run_dir)
    if not (run_dir / RECORD).is_file() and not any(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        return set()
    parts, _ = find_parts(run_dir)
    return {r for part in parts for r in part.rounds}


# ------------------------------------------------------------------------------------------------ the plan


def is_synced(file: Path) -> bool:
    """Whether ``wandb sync`` uploaded ``file`` already (it leaves ``<file>.synced`` and skips such files)."""
    return file.with_name(file.name + ".synced").exists()


@dataclass
class Upload:
    """One ``wandb sync`` of the plan.

    Attributes:
        part: The part.
        source: The directory to sync: the part's own, or its trimmed copy.
        repeated: Its rounds that a later part logs again (it resumed from an earlier checkpoint).
        synced: Already uploaded (nothing to run; what it holds is on W&B as it was).
    """

    part: Part
    source: Path
    repeated: list[int]
    synced: bool

    @property
    def trimmed(self) -> bool:
        """Whether it is uploaded from a copy without the repeated rounds."""
        return self.source != self.part.dir


def plan(parts: Sequence[Part]) -> list[Upload]:
    """What to upload, in order.

    Raises:
        SyncRefused: If a part after the first is not recorded as resumed (W&B would overwrite the history with it),
            or the installed wandb does not record resumes in offline runs.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    if "resume" not in pb.RunRecord.DESCRIPTOR.fields_by_name:
        raise SyncRefused(
            "the installed wandb does not record `resume` in offline runs, so its `wandb sync` cannot append a "
            "resumed run (wandb 0.31 does); upgrade wandb"
        )
    for part in parts[1:]:
        if not part.resume:
            raise SyncRefused(
                f"{part.dir} continues W&B run {part.run_id} but its run record does not ask to resume it: "
                "`wandb sync` would upload its rows with steps from 0 again; was it written by wandb < 0.31?"
            )
    uploads = []
    for i, part in enumerate(parts):
        # A later part starts after its checkpoint's round: this part's rows from that round on were run again.
        first_rerun = min((r for p in parts[i + 1 :] for r in p.rounds), default=None)
        repeated = sorted({r for r in part.rounds if first_rerun is not None and r >= first_rerun})
        if is_synced(part.file):  # uploaded as it is: too late to leave rows out
            uploads.append(Upload(part, part.dir, repeated, synced=True))
        else:
            source = part.trimmed_file if repeated else part.file
            uploads.append(Upload(part, source.parent, repeated, synced=is_synced(source)))
    return uploads


def uploaded_rounds(uploads: Sequence[Upload]) -> list[tuple[int, int]]:
    """The W&B history the plan makes, as (upload index, round) per history row, in order."""
    return [
        (i, r) for i, u in enumerate(uploads) for r in u.part.rounds if not (u.trimmed and r in u.repeated)
    ]  # fmt: skip


def recorded_rounds(run_dir: Path) -> list[int] | None:
    """The rounds of the run's ``rounds.csv`` (None when ``run_dir`` has none: a W&B folder was given)."""
    path = Path(run_dir) / "rounds.csv"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8", newline="") as f:
        return [int(float(row["round"])) for row in csv.DictReader(f) if row.get("round")]


def history_problems(uploads: Sequence[Upload], recorded: list[int] | None) -> list[str]:
    """What is wrong with the history the plan makes, by round: gaps, duplicates, rounds ``rounds.csv`` lacks.

    A round appears in the history more than once when rows of it come from two parts or it comes back after a
    later round; two rows of one round in a row from one part are one round (a callback's additions to it).
    """
    rows = uploaded_rounds(uploads)
    problems = []
    seen: dict[int, int] = {}
    duplicates, last = set(), None
    for index, r in rows:
        if r in seen and (seen[r] != index or last != r):
            duplicates.add(r)
        seen.setdefault(r, index)
        last = r
    if duplicates:
        problems.append(
            f"rounds {sorted(duplicates)} appear more than once in the history (parts uploaded before this helper "
            "could leave rows out: W&B holds them as uploaded)"
        )
    if recorded is not None:
        gaps = sorted(set(recorded) - set(seen))
        extra = sorted(set(seen) - set(recorded))
        if gaps:
            problems.append(
                f"rounds {gaps} are in rounds.csv but in no W&B part (lost when the run was killed): resuming the "
                "run with this version logs them again from tracked_rounds.jsonl before its next round; a run "
                "started before that record existed cannot get them back"
            )
        if extra:
            problems.append(
                f"rounds {extra} are in W&B but not in rounds.csv (logged after the last checkpoint of a run that "
                "was killed and not resumed): resume it to run them again"
            )
    return problems


def write_trimmed(upload: Upload) -> None:
    """Write the part's copy without the repeated rounds' history rows (its ``files/`` folder copied along)."""
    part, target = upload.part, upload.part.trimmed_file
    if target.parent.exists():
        shutil.rmtree(target.parent)  # an earlier, not uploaded copy: written again from the original
    target.parent.mkdir(parents=True)
    kept = (p for p in read_payloads(part.file) if _round_of(p) not in upload.repeated)
    write_payloads(target, kept)
    if (part.dir / "files").is_dir():  # W&B uploads the run's files from <sync dir>/files
        shutil.copytree(part.dir / "files", target.parent / "files", symlinks=True)


def _round_of(payload: bytes) -> int | None:
    from wandb.proto import wandb_internal_pb2 as pb

    record = pb.Record()
    record.ParseFromString(payload)
    return history_round(record)


def default_wandb() -> list[str]:
    """The ``wandb`` command of this Python environment (the one whose sync behaviour was checked)."""
    beside = Path(sys.executable).parent / ("wandb.exe" if os.name == "nt" else "wandb")
    return [str(beside)] if beside.is_file() else [sys.executable, "-m", "wandb"]


def commands(uploads: Sequence[Upload], wandb: Sequence[str], extra: Sequence[str] = ()) -> list[list[str]]:
    """One ``wandb sync`` per part still to upload, in order (each waits for the one before: W&B resumes from it)."""
    return [[*wandb, "sync", *extra, str(u.source)] for u in uploads if not u.synced]


def resume_message(run_dir: Path, run_id: str) -> str:
    """What the terminal says when an offline W&B run is resumed."""
    return (
        f"W&B offline resume: this start writes a new offline W&B directory for run {run_id} (W&B cannot reopen "
        f"the earlier one). To upload the run as one W&B run with one history, run `{COMMAND} {run_dir}` "
        "(it syncs the parts in order and leaves out rounds this resume runs again); do not `wandb sync` only the "
        "newest directory, nor the parts out of order: an earlier part synced later lands behind it, steps repeated."
    )


# ------------------------------------------------------------------------------------------------ the CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Upload a run's offline W&B parts in order; with ``--dry-run``, print the plan and the commands only.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``); arguments after ``--`` go to every
            ``wandb sync`` (e.g. ``-- -p my-project -e my-team``).

    Returns:
        0 when everything was uploaded (or would be), 2 when refused, else the first failing ``wandb sync``'s status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (or a W&B folder holding its offline-run-*)")
    parser.add_argument("--dry-run", "--print", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--wandb", default=None, help="the wandb command (default: this environment's)")
    args = parser.parse_args(argv)
    wandb = shlex.split(args.wandb) if args.wandb else default_wandb()
    try:
        parts, notes = find_parts(args.run_dir)
        uploads = plan(parts)
    except SyncRefused as err:
        print(f"{COMMAND}: refused: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}")
    run = parts[0]
    print(f"W&B run {'/'.join(x for x in (run.entity, run.project, run.run_id) if x)}: {len(parts)} part(s), in order")
    for i, u in enumerate(uploads, 1):
        rounds = f"rounds {u.part.rounds[0]}-{u.part.rounds[-1]}" if u.part.rounds else "no rounds"
        print(f"  {i}. {u.part.dir} ({rounds}){' (already uploaded)' if u.synced else ''}")
        if u.repeated and u.trimmed:
            print(f"     rounds {u.repeated} are run again by a later part: uploaded from {u.source} without them")
        elif u.repeated:
            print(f"     rounds {u.repeated} are run again by a later part: W&B shows them twice (uploaded before)")
    recorded = recorded_rounds(args.run_dir)
    problems = history_problems(uploads, recorded)
    history = sorted({r for _, r in uploaded_rounds(uploads)})
    if not problems:
        span = f"rounds {history[0]}-{history[-1]}" if history else "no rounds"
        print(f"history after the upload: {span}, each once{', as in rounds.csv' if recorded is not None else ''}")
    for problem in problems:
        print(f"warning: {problem}")
    todo = [u for u in uploads if not u.synced]
    for upload, cmd in zip(todo, commands(todo, wandb, extra)):
        print(("would run: " if args.dry_run else "running: ") + shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        if upload.trimmed:
            write_trimmed(upload)
        status = subprocess.run(cmd, check=False).returncode
        if status != 0:
            print(f"{COMMAND}: `wandb sync` failed ({status}); later parts were not uploaded", file=sys.stderr)
            return status
    if not todo:
        print("nothing to upload: every part is uploaded already")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
