"""Reading state files safely: the one loader every layer uses for files written with ``torch.save``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_state_file(path: Path, what: str) -> dict[str, Any]:
    """``torch.load`` a dict onto the CPU with ``weights_only=True`` (no arbitrary unpickling).

    Args:
        path: The file.
        what: What the file is, for the error messages (e.g. ``"checkpoint"``).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        RuntimeError: If the file is unreadable (truncated, corrupt) or holds no dict, naming it.

    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises several types for a damaged file
        raise RuntimeError(f"{what} {path} is unreadable (truncated or corrupt): {err}") from err
    if not isinstance(state, dict):
        raise RuntimeError(f"{what} {path} does not hold a dict")
    return state
