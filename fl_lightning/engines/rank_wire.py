"""Messages between the ranks of a torch.distributed run: encoded tasks and replies, sent as tensors over gloo.

A message travels as the pieces of its encoding (:func:`~fl_lightning.wire.protocol.encode_parts`): first its
length and the sizes of its parts, then the parts. A tensor of at least :data:`JOIN_BELOW` bytes is sent from its
own memory, without a copy; smaller pieces are joined into one send, which bounds the number of sends. The
receiver checks what was announced before it allocates anything, receives the parts into one buffer and decodes
that as any message (:func:`~fl_lightning.wire.protocol.decode`), so a rank's bytes get the same checks as bytes
from the network.

A batch of tasks sends each distinct model state once (:func:`pack_tasks`): the tasks of a round all carry
their group's state, which would otherwise travel once per client.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import Task

JOIN_BELOW = 256 * 2**10  # bytes; a smaller tensor is copied into a joined send rather than sent on its own
# A message alternates joined pieces and tensors sent on their own, so it has at most this many parts.
MAX_PARTS = 2 * (protocol.MAX_BYTES // JOIN_BELOW) + 1


class Sending:
    """The sends of one message, under way; :meth:`wait` for them before the sent tensors may change."""

    def __init__(self, works: list[dist.Work], parts: list[Tensor]) -> None:
        self._works, self._parts = works, parts  # the parts stay referenced until the sends are done

    def wait(self) -> None:
        """Block until every part has been sent."""
        for work in self._works:
            work.wait()
        self._parts = []


def send(obj: Any, dst: int) -> Sending:
    """Send ``obj`` (plain data, tasks, replies) to rank ``dst``; the parts go on in the background."""
    head, buffers = protocol.encode_parts(obj)
    parts = _join_small(head, buffers)
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    dist.send(torch.tensor([int(sizes.sum()), len(parts)], dtype=torch.int64), dst)
    dist.send(sizes, dst)
    return Sending([dist.isend(part, dst) for part in parts], parts)


def _join_small(head: bytes, buffers: list[Tensor]) -> list[Tensor]:
    """The parts to send: each buffer of at least :data:`JOIN_BELOW` bytes as it is, the pieces between joined."""
    parts: list[Tensor] = []
    small: list[Any] = [head]
    for buffer in buffers:
        if buffer.numel() < JOIN_BELOW:
            small.append(buffer.numpy())
            continue
        parts += [_joined(small), buffer] if small else [buffer]
        small = []
    return parts + [_joined(small)] if small else parts


def _joined(pieces: list[Any]) -> Tensor:
    return torch.frombuffer(bytearray().join(pieces), dtype=torch.uint8)


def recv(src: int) -> tuple[Any, int]:
    """Receive one message from rank ``src``; ``(object, bytes)``.

    Raises:
        protocol.MessageError: If ``src`` announces an impossible length or parts (refused before the receive
            buffer is allocated) or sends a malformed message; the error names the rank.

    """
    announced = torch.zeros(2, dtype=torch.int64)
    dist.recv(announced, src)
    total, count = _check_announcement(int(announced[0]), int(announced[1]), src)
    sizes = torch.zeros(count, dtype=torch.int64)
    dist.recv(sizes, src)
    bounds = _part_bounds(sizes.tolist(), total, src)
    data = torch.empty(total, dtype=torch.uint8)
    for start, end in bounds:
        dist.recv(data[start:end], src)
    try:  # decoded from the receive buffer itself: its tensors are copies, so no copy of the whole message first
        return protocol.decode(memoryview(data.numpy())), total
    except protocol.MessageError as err:
        raise protocol.MessageError(f"rank {src} sent a malformed message: {err}") from None


def _check_announcement(total: int, count: int, src: int) -> tuple[int, int]:
    """The length and number of parts a rank announced for its next message, checked before any allocation.

    Raises:
        protocol.MessageError: If no message has that length (shorter than an empty message, or past
            :data:`protocol.MAX_BYTES`), or it cannot have that many parts (each holds at least one byte).

    """
    if not protocol.PREFIX <= total <= protocol.MAX_BYTES:
        raise protocol.MessageError(
            f"rank {src} announced a message of {total} bytes (a message has {protocol.PREFIX} .. {protocol.MAX_BYTES})"
        )
    if not 1 <= count <= min(total, MAX_PARTS):
        raise protocol.MessageError(
            f"rank {src} announced {count} parts for a message of {total} bytes (1 .. {min(total, MAX_PARTS)})"
        )
    return total, count


def _part_bounds(sizes: list[int], total: int, src: int) -> list[tuple[int, int]]:
    """Where each announced part goes in the receive buffer: ``[(start, end), …]``.

    Raises:
        protocol.MessageError: If a part is empty or the parts do not add up to the announced length.

    """
    if min(sizes) < 1 or sum(sizes) != total:
        raise protocol.MessageError(
            f"rank {src} announced parts that are empty or do not add up to its {total} bytes: {sizes[:10]}"
        )
    offsets = list(itertools.accumulate(sizes, initial=0))
    return list(zip(offsets, offsets[1:]))


def pack_tasks(tasks: list[Task]) -> dict[str, Any]:
    """The ``tasks`` message for a rank: each distinct state (the same object) once, and which task has which."""
    states: list[dict[str, Any]] = []
    index: dict[int, int] = {}
    state_of: list[int] = []
    for task in tasks:
        if task.state is None:
            state_of.append(-1)
            continue
        i = index.setdefault(id(task.state), len(states))  # the tasks keep their states alive: ids stay unique
        if i == len(states):
            states.append(task.state)
        state_of.append(i)
    return {
        "op": "tasks",
        "tasks": [dataclasses.replace(task, state=None) for task in tasks],
        "states": states,
        "state_of": state_of,
    }


def unpack_tasks(message: dict[str, Any]) -> list[Task]:
    """The tasks of a ``tasks`` message from :func:`pack_tasks`, each with its state (shared where it was).

    Raises:
        protocol.MessageError: If the message is not one :func:`pack_tasks` builds.
    """
    tasks, states, state_of = message.get("tasks"), message.get("states"), message.get("state_of")
    if not (isinstance(tasks, list) and all(isinstance(t, Task) and t.state is None for t in tasks)):
        raise protocol.MessageError("rank 0's 'tasks' message holds something other than a list of tasks")
    if not (isinstance(states, list) and all(isinstance(s, dict) for s in states)):
        raise protocol.MessageError("rank 0's 'tasks' message holds states that are not a list of dicts")
    if not (
        isinstance(state_of, list)
        and len(state_of) == len(tasks)
        and all(type(i) is int and -1 <= i < len(states) for i in state_of)
    ):
        raise protocol.MessageError(
            f"rank 0's 'tasks' message says which state each of its {len(tasks)} tasks has with {state_of!r:.200}"
        )
    return [dataclasses.replace(t, state=None if i < 0 else states[i]) for t, i in zip(tasks, state_of, strict=True)]
