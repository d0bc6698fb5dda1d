"""Trained FedER generators and buffers in the run directory: ``<run>/generators/<node>.pt``, reused on resume."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from torch import Tensor

from fl_lightning.checkpoint import load_state_file, save_checkpoint

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


def save_node_gan(
    path: Path,
    generator: dict[str, Tensor],
    latents: Tensor,
    labels: Tensor,
    images: Tensor,
    fingerprint: dict[str, Any],
) -> None:
    """Write a node's generator weights, its buffer (codes, labels, images) and what they were made for, atomically."""
    state = {
        "version": FORMAT_VERSION,
        "generator": generator,
        "latents": latents,
        "labels": labels,
        "images": images,
        "fingerprint": fingerprint,
    }
    save_checkpoint(Path(path), state)


def load_node_gan(path: Path) -> dict[str, Any]:
    """Read what :func:`save_node_gan` wrote (``weights_only=True``).

    Raises:
        FileNotFoundError: If the file is missing.
        RuntimeError: If it is unreadable or not a generator file, naming it.

    """
    state = load_state_file(path, "generator file")
    if state.get("version") != FORMAT_VERSION:
        raise RuntimeError(f"{path} is not a FedER generator file (version {FORMAT_VERSION})")
    return state


def fingerprint_mismatch(stored: dict[str, Any], expected: dict[str, Any], keys: list[str] | None = None) -> list[str]:
    """Keys (all of ``expected``'s, or ``keys``) whose stored value differs, as ``key: stored != expected`` lines."""
    return [
        f"{k}: {stored.get(k)!r} != {expected[k]!r}"
        for k in (keys if keys is not None else expected)
        if stored.get(k) != expected[k]
    ]
