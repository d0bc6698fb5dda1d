"""Helpers for state dicts that cross the client/server line (plain tensors only)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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
