"""The on-disk layout of a node's generated data (FedER's generators and buffers): names, digest, reader.

Written by the core (:mod:`callbacks.feder.generator_store`), read by FedER and by the synthetic-data baselines
(:class:`datamodules.synthetic.SyntheticFederated`); this reading half lives in the data layer so that
datamodules import nothing of the core.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from torch import Tensor

from datamodules.files import load_state_file

GENERATORS_DIR = "generators"
FORMAT_VERSION = 1


def generator_path(directory: Path, node: str) -> Path:
    """The file of ``node``'s generator and buffer inside a generators directory."""
    return Path(directory) / f"{node}.pt"


def data_digest(images: Tensor, labels: Tensor) -> str:
    """A short digest of a node's training data, so a generator is never reused for other data."""
    h = hashlib.sha1()
    for t in (images, labels):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def load_node_gan(path: Path) -> dict[str, Any]:
    """Read what :func:`callbacks.feder.generator_store.save_node_gan` wrote (``weights_only=True``).

    Raises:
        FileNotFoundError: If the file is missing.
        RuntimeError: If it is unreadable or not a generator file, naming it.

    """
    state = load_state_file(path, "generator file")
    if state.get("version") != FORMAT_VERSION:
        raise RuntimeError(f"{path} is not a FedER generator file (version {FORMAT_VERSION})")
    return state
