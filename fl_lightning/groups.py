"""Splitting a model group: pure functions that make the child groups (the Federation swaps them in)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fl_lightning.ops import clone_state
from fl_lightning.state import ModelGroup


def split_by_clients(group: ModelGroup, parts: list[list[str]]) -> list[ModelGroup]:
    """One child per part of ``group``'s members, each starting from the group's current global state.

    Raises:
        ValueError: If the parts do not partition the group's members.
    """
    if sorted(c for part in parts for c in part) != sorted(group.members) or any(not p for p in parts):
        raise ValueError(f"split of group {group.name!r}: {parts} is not a partition of {group.members}")
    return [ModelGroup(f"{group.name}.{i}", clone_state(group.state), list(part)) for i, part in enumerate(parts)]


def split_by_samples(
    group: ModelGroup, assignments: dict[str, torch.Tensor], n_parts: int, num_samples: Callable[[str], int]
) -> list[ModelGroup]:
    """``n_parts`` sample-level children: part m trains on each member's samples assigned m.

    Every part starts from the group's current global state; a client belongs to every part it has samples of.

    Args:
        group: The group to split (its members must all be in ``assignments``).
        assignments: Per member, the part id (0 … n_parts − 1) of each of its training samples.
        n_parts: Number of parts.
        num_samples: A member's training samples in ``group`` (what its assignment must cover).

    Returns:
        The children (parts without any sample are left out).

    Raises:
        ValueError: If a member has no assignment or an assignment does not cover its training samples.
    """
    for cid in group.members:
        a = assignments.get(cid)
        if a is None or len(a) != num_samples(cid) or (len(a) and int(a.max()) >= n_parts):
            raise ValueError(f"split of group {group.name!r}: no valid assignment for client {cid!r}")
    children = []
    for m in range(n_parts):
        subsets = {}
        for cid in group.members:
            own = torch.nonzero(assignments[cid] == m).flatten()
            base = group.subsets[cid] if group.subsets is not None else None
            if len(own):
                subsets[cid] = base[own] if base is not None else own
        if subsets:
            children.append(ModelGroup(f"{group.name}.{m}", clone_state(group.state), list(subsets), subsets))
    return children
