"""Model groups: splitting one (pure functions that make the children), swapping them in, peer-to-peer passing."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fl_lightning.callback import ModelGroup
from fl_lightning.ops import clone_state
from fl_lightning.server.selection import random_cycle
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import Task

if TYPE_CHECKING:
    from fl_lightning.callback import ServerView


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


def regroup(server: ServerView, group: ModelGroup, children: list[ModelGroup]) -> list[ModelGroup]:
    """Swap ``group`` for ``children`` in the server's groups; each member's runtime moves or copies its states."""
    targets: dict[str, list[str]] = {}
    for child in children:
        for cid in child.members:
            targets.setdefault(cid, []).append(child.name)
    options = [{"from": group.name, "to": names} for names in targets.values()]
    tasks = [Task(protocol.REGROUP, server.round, c, group.name, options=o) for c, o in zip(targets, options)]
    list(server.transport.stream(tasks))
    at = server.groups.index(group)
    server.groups[at : at + 1] = children
    return children


def pass_on(server: ServerView, r: int) -> None:
    """Peer-to-peer exchange: a fresh random cycle; every node passes its model to its successor via the relay.

    The server is the relay (engines have no node-to-node links): it takes each node's model and puts it on
    the successor. Callbacks relay what they pass on in ``on_pass_on`` (e.g. replay buffers); when a
    callback's ``moves_models()`` is False (FedER-A), models stay where they are.
    """
    move = all(cb.moves_models() for cb in server.callbacks)
    for group in server.groups:
        successor = random_cycle(group.members, r, server.seed)
        for cb in server.callbacks:
            cb.on_pass_on(server, r, successor)
        if move:
            take = [Task(protocol.TAKE_PRIVATE, r, c, group.name) for c in group.members]
            held = {t.client_id: reply.state for t, reply in zip(take, server.transport.stream(take))}
            put = [
                Task(protocol.PUT_PRIVATE, r, successor[c], group.name, state=state)
                for c, state in held.items()
                if state is not None
            ]
            list(server.transport.stream(put))
