"""Round checkpoints: written atomically, loaded with ``weights_only=True``, never a half-written ``last``."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

# The one safe loader (weights_only) for every state file, and its atomic writer.
from datamodules.files import load_state_file
from datamodules.files import save_state_file as save_checkpoint
from fl_lightning.outputs.client_store import STORE_DIR, ClientStateStore, expand

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^round-(\d{5})\.ckpt$")
# What save_checkpoint and run_dir.atomic_write_text name their temporary files: ".<final name>.<random>.tmp".
_TEMP = re.compile(r"^\..+\.tmp$")


def checkpoint_path(run_dir: Path, round_idx: int) -> Path:
    """Where the checkpoint after ``round_idx`` completed rounds goes."""
    return run_dir / CHECKPOINT_DIR / f"round-{round_idx:05d}.ckpt"


def write_round_checkpoint(path: Path, state: dict[str, Any], store: ClientStateStore, keep: int) -> None:
    """Write a round checkpoint whose clients' states go to ``store`` (only the changed ones), then prune.

    The clients' state file is durable before the checkpoint that names it is renamed into place, so every
    checkpoint that exists can be loaded whole.

    Args:
        path: The checkpoint's path (:func:`checkpoint_path`).
        state: The run's state (``Federation.state_dict``), with the full runtime state under ``"runtime"``.
        store: The run's client state store.
        keep: Round checkpoints to keep (0: all); state files none of them names are deleted.

    """
    state = {**state, "runtime": store.write(state["runtime"], path, save_checkpoint)}
    save_checkpoint(path, state)
    store.remember(path, state["runtime"])
    prune_checkpoints(path.parent.parent, keep)
    store.prune(list_checkpoints(path.parent.parent))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a round checkpoint, its clients' states included, onto the CPU with ``weights_only=True`` (no unpickling).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        RuntimeError: If the file is not a readable checkpoint (truncated, or not ours) or a client state file it
            names is missing, damaged, not the one it was written with (another round's) or lacks a client's
            entry, naming the file.

    """
    state = load_state_file(path, "checkpoint")
    if "round" not in state:
        raise RuntimeError(f"{path} is not a fl_lightning round checkpoint")
    if "runtime" in state:
        state["runtime"] = expand(state["runtime"], path.parent)
    return state


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Round checkpoints of a run directory, newest round first."""
    directory = run_dir / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)


def find_last_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of ``run_dir`` that loads, with its content; damaged ones are skipped with a warning."""
    for path in list_checkpoints(run_dir):
        try:
            return path, load_checkpoint(path)
        except RuntimeError as err:
            warnings.warn(f"skipping {err}", stacklevel=2)
    return None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest round checkpoints (0 keeps all)."""
    if keep > 0:
        for path in list_checkpoints(run_dir)[keep:]:
            path.unlink(missing_ok=True)


def remove_orphan_temps(run_dir: Path) -> list[Path]:
    """Delete the temporary files a killed run left behind (a checkpoint or record caught mid-write).

    Call it only while holding the run directory (see :class:`fl_lightning.outputs.run_dir.RunDirectory`): a temporary
    file of a live writer would otherwise be taken from under it.

    Args:
        run_dir: The run directory; its top level and its ``checkpoints/`` are cleaned.

    Returns:
        The files removed.
    """
    removed = []
    for directory in (Path(run_dir), Path(run_dir) / CHECKPOINT_DIR, Path(run_dir) / CHECKPOINT_DIR / STORE_DIR):
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            if _TEMP.match(path.name) and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed
