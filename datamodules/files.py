"""State files: the one safe loader every layer uses for files written with ``torch.save``, and their atomic writer."""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_state_file(path: Path, what: str, sha256: str | None = None) -> dict[str, Any]:
    """``torch.load`` a dict onto the CPU with ``weights_only=True`` (no arbitrary unpickling).

    Args:
        path: The file.
        what: What the file is, for the error messages (e.g. ``"checkpoint"``).
        sha256: The digest the file must have (the one recorded when it was written); None checks nothing.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        RuntimeError: If the file is unreadable (truncated, corrupt, not a state file), holds no dict, or its
            digest is not ``sha256``, naming it.

    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise RuntimeError(
            f"{what} {path} is not the file its checkpoint was written with (its sha256 differs from the recorded "
            "one: replaced or changed since)"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises several types for a damaged file
        raise RuntimeError(
            f"{what} {path} is unreadable (truncated, corrupt or not a state file): {_reason(err)}"
        ) from None
    if not isinstance(state, dict):
        raise RuntimeError(f"{what} {path} does not hold a dict")
    return state


def _reason(err: BaseException) -> str:
    """The loader's own reason in one line, without its advice to load the file unsafely.

    For a file that holds more than tensors and plain data, torch suggests retrying with ``weights_only=False``,
    which would run whatever code the file carries: never pass that on.
    """
    if "weights_only" in str(err):
        return "it holds objects other than tensors and plain data"
    first = str(err).strip().splitlines()
    return first[0] if first else type(err).__name__


def new_file_mode() -> int:
    """The mode every file of a run directory gets: what ``open`` gives a new file, 0666 less the umask.

    Temporary files (``mkstemp``) start as 0600; without this, CSVs and checkpoints renamed from them stayed 0600
    while the figures got 0644. One rule for all: the user's umask decides (``umask 077`` keeps a run private).
    """
    try:  # Linux says it without changing it (os.umask can only be read by setting it, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def save_state_file(path: Path, state: dict[str, Any]) -> str:
    """``torch.save`` to a temporary file in the same directory, fsync, then rename over ``path``.

    A crash at any moment leaves either the previous file or the complete new one, never a torso:
    the temporary name does not match the checkpoint pattern, so it is never taken for one.

    Returns:
        The sha256 of the file written (hex), read back before the rename.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, new_file_mode())
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        digest = file_digest(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest
