"""Find the checkpoint that ``--federation.resume`` names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fl_lightning.checkpoint import find_last_checkpoint, list_checkpoints, load_checkpoint


def resolve_resume(resume: str, output_dir: str | Path, run_name: str | None) -> tuple[Path, Path, dict[str, Any]]:
    """The run directory, checkpoint path and checkpoint content to resume from.

    Args:
        resume: ``"last"`` (the newest readable checkpoint of ``output_dir/run_name``, or, without a
            run name, of the run under ``output_dir`` with the newest checkpoint), a run directory,
            or a checkpoint file.
        output_dir: ``federation.output_dir``.
        run_name: ``federation.run_name``.

    Raises:
        FileNotFoundError: If nothing to resume from exists, naming where it looked.

    """
    if resume == "last":
        if run_name is not None:
            candidates = [Path(output_dir) / run_name]
        else:
            runs = [d for d in Path(output_dir).glob("*") if d.is_dir() and list_checkpoints(d)]
            candidates = sorted(runs, key=lambda d: list_checkpoints(d)[0].stat().st_mtime, reverse=True)
        for run_dir in candidates:
            found = find_last_checkpoint(run_dir)
            if found is not None:
                return run_dir, found[0], found[1]
        where = candidates[0] if run_name is not None else Path(output_dir)
        raise FileNotFoundError(f"federation.resume=last: no readable round checkpoint under {where}")
    path = Path(resume)
    if path.is_dir():
        found = find_last_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"federation.resume={resume}: no readable round checkpoint in {path}")
        return path, found[0], found[1]
    return path.parent.parent, path, load_checkpoint(path)
