"""Trained FedER generators and buffers in the run directory: ``<run>/generators/<node>.pt``, reused on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from datamodules.files import save_state_file
from datamodules.generated import FORMAT_VERSION, GENERATORS_DIR, data_digest, generator_path, load_node_gan

__all__ = ["GENERATORS_DIR", "data_digest", "fingerprint_mismatch", "generator_path", "load_node_gan", "save_node_gan"]


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
    save_state_file(Path(path), state)


def fingerprint_mismatch(stored: dict[str, Any], expected: dict[str, Any], keys: list[str] | None = None) -> list[str]:
    """Keys (all of ``expected``'s, or ``keys``) whose stored value differs, as ``key: stored != expected`` lines."""
    return [
        f"{k}: {stored.get(k)!r} != {expected[k]!r}"
        for k in (keys if keys is not None else expected)
        if stored.get(k) != expected[k]
    ]
