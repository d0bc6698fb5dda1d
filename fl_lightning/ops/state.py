"""Helpers for state dicts that cross the client/server line (plain tensors only)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

StateDict = dict[str, Tensor]


def clone_state(state: Mapping[str, Tensor], device: torch.device | str = "cpu") -> StateDict:
    """Detached copies of every tensor, moved to ``device``.

    Copies are needed because ``module.state_dict()`` returns views that the next client fit
    would overwrite in place.

    Args:
        state: A state dict.
        device: Where the copies live (the server keeps them on the CPU by default).

    Returns:
        A new dict with independent tensors.

    """
    return {k: v.detach().to(device, copy=True) for k, v in state.items()}


def select_keys(state: Mapping[str, Tensor], keys: Iterable[str]) -> StateDict:
    """The sub-dict of ``state`` restricted to ``keys`` (keys missing from ``state`` are skipped)."""
    return {k: state[k] for k in keys if k in state}


def state_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s state dict (parameters and buffers)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def all_finite(state: Mapping[str, Tensor]) -> bool:
    """Whether every floating tensor is free of NaN and inf (one reduction per tensor, one check in total)."""
    sums = [v.sum(dtype=torch.float64) for v in state.values() if v.is_floating_point()]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())


def nest_by_group(flat: Mapping[tuple[str, str], Any]) -> dict[str, dict[str, Any]]:
    """{(group, client): v} → {group: {client: v}} (checkpoints hold string keys only)."""
    out: dict[str, dict[str, Any]] = {}
    for (group, client), value in flat.items():
        out.setdefault(group, {})[client] = value
    return out


def unnest_by_group(nested: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str], Any]:
    """Inverse of :func:`nest_by_group`."""
    return {(group, client): value for group, inner in nested.items() for client, value in inner.items()}
