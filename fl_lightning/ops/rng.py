"""The process's global random generators (Python, NumPy, torch CPU and CUDA): capture and restore.

A checkpoint stores them so a resume draws what the uninterrupted run drew (the server's draws); every client
task runs inside :func:`seeded_rng`, so what it draws depends on its own seed only and disturbs no other draw.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) global RNG states as weights-only-loadable objects."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """Run the block with every global generator seeded from ``seed``; restore the states they had afterwards.

    Python's ``random``, NumPy's and torch's (CPU and every CUDA device) generators are seeded from ``seed``
    (NumPy's from ``seed mod 2³²``, its limit), so the block's draws — dropout masks, a transform's random crop —
    are a function of ``seed`` alone, not of what ran before it in the process; the outer draws carry on after the
    block as if it had not run, an exception included.
    """
    saved = rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds the CUDA devices' generators too
    try:
        yield
    finally:
        set_rng_state(saved)


def _as_tuple(value: Any) -> Any:
    """Lists back to tuples, recursively (``random.setstate`` insists on tuples)."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
