"""The messages that cross the client/server boundary, and their byte encoding (which never unpickles).

A :class:`Task` goes from the server to one client: ``fit``, ``evaluate``, a named callback ``query``, or one
of the runtime's own operations (``regroup``, ``take_private``, ``put_private``). A :class:`Reply` comes back.
Both hold only plain data: tensors, numbers, strings, booleans, ``None``, lists, tuples and dicts.

The encoding is a JSON header describing the structure (tensors by dtype, shape and byte offset) followed by
the raw tensor bytes. Decoding parses JSON and copies bytes into fresh tensors: nothing is unpickled, so a
message from the network can at worst be malformed (a clear error), never run code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

MAGIC = b"FLM1"
_TAG = "__fl__"  # key of tagged JSON objects (tensors, tuples, dicts with non-string keys, non-finite floats)

FIT, EVALUATE, QUERY = "fit", "evaluate", "query"
REGROUP, TAKE_PRIVATE, PUT_PRIVATE = "regroup", "take_private", "put_private"
KINDS = (FIT, EVALUATE, QUERY, REGROUP, TAKE_PRIVATE, PUT_PRIVATE)


@dataclass
class Task:
    """What the server asks of one client.

    Attributes:
        kind: ``fit``, ``evaluate``, ``query`` or a runtime operation (see module docstring).
        round: 0-based index of the running round.
        client_id: The client that handles it.
        group: Name of the model group the task is about.
        state: The group's global state (the model the client starts from or evaluates); ``None`` if not needed.
        epochs: Local epochs of a fit.
        steps: Local steps of a fit instead of epochs (``None``: epochs).
        lr_factor: Factor of the configured learning rate for this fit (a per-round schedule).
        subset: Sample-level groups: the indices of the client's training samples this group trains on.
        query: For ``query`` tasks, ``"<callback state key>/<name>"``.
        options: Settings of the task itself (e.g. what an evaluation reports).
        payloads: Per-callback payloads, keyed by the callback's ``state_key``.

    """

    kind: str
    round: int
    client_id: str
    group: str = ""
    state: dict[str, Tensor] | None = None
    epochs: int = 1
    steps: int | None = None
    lr_factor: float = 1.0
    subset: Tensor | None = None
    query: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    payloads: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """What one client answers.

    Attributes:
        client_id: The client.
        group: The group the task was about.
        state: The client's state after a fit (its whole state dict; methods may replace parts, e.g. FedNova).
        num_samples: Training samples of the fit (n_i, or n_{i,m} in a sample-level group).
        num_steps: Optimiser steps taken (τ_i).
        metrics: Training metrics of a fit, or ``{model: metrics}`` of an evaluation.
        payloads: Per-callback payloads, keyed by the callback's ``state_key``.
        error: Why the client failed (its update is left out of the round), or ``None``.

    """

    client_id: str
    group: str = ""
    state: dict[str, Tensor] | None = None
    num_samples: int = 0
    num_steps: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    payloads: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class MessageError(ValueError):
    """A byte string that is not a well-formed message."""


# ---------------------------------------------------------------------------------------------------- encoding
def _to_json(value: Any, buffers: list[Tensor]) -> Any:
    if isinstance(value, Tensor):
        t = value.detach()  # left where it is: counting bytes (encoded_size) needs no copy off a GPU
        buffers.append(t)
        return {
            _TAG: "tensor",
            "i": len(buffers) - 1,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, (Task, Reply)):  # a message inside a message (a relayed task, e.g. a nested federation)
        return _to_json_tagged(_plain(value), buffers)
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "v": repr(value)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _to_json(v, buffers) for k, v in value.items()}
        return {_TAG: "map", "items": [[_to_json(k, buffers), _to_json(v, buffers)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_to_json(v, buffers) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_to_json(v, buffers) for v in value]}
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy scalars
        return _to_json(value.item(), buffers)
    raise TypeError(f"cannot encode a {type(value).__name__} in a message (plain data only)")


def _header(obj: Any) -> tuple[bytes, list[Tensor]]:
    buffers: list[Tensor] = []
    tree = _to_json_tagged(obj, buffers)
    sizes = [t.numel() * t.element_size() for t in buffers]
    return json.dumps({"tree": tree, "sizes": sizes}, separators=(",", ":")).encode(), buffers


def encode(obj: Any) -> bytes:
    """Plain data (or a :class:`Task`/:class:`Reply`) → bytes: magic, header length, JSON header, tensor bytes."""
    header, buffers = _header(_plain(obj))
    parts = [MAGIC, struct.pack("<Q", len(header)), header]
    for t in buffers:
        if t.numel():
            parts.append(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def encoded_size(obj: Any) -> int:
    """``len(encode(obj))`` without copying any tensor data (the in-process transport's communication count)."""
    header, buffers = _header(_plain(obj))
    return len(MAGIC) + 8 + len(header) + sum(t.numel() * t.element_size() for t in buffers)


def decode(data: bytes) -> Any:
    """Bytes from :func:`encode` → the same plain data (a :class:`Task`/:class:`Reply` comes back as one).

    Raises:
        MessageError: If ``data`` is not a complete message.

    """
    if data[:4] != MAGIC or len(data) < 12:
        raise MessageError("not an fl_lightning message (bad magic or too short)")
    (n,) = struct.unpack("<Q", data[4:12])
    try:
        head = json.loads(data[12 : 12 + n])
        sizes, tree = head["sizes"], head["tree"]
    except (ValueError, KeyError, TypeError) as err:
        raise MessageError(f"malformed message header: {err}") from None
    offsets, pos = [], 12 + n
    for size in sizes:
        offsets.append(pos)
        pos += int(size)
    if pos != len(data):
        raise MessageError(f"message length {len(data)} does not match its header ({pos})")
    view = memoryview(data)

    def tensor(node: dict[str, Any]) -> Tensor:
        i = int(node["i"])
        dtype = getattr(torch, node["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise MessageError(f"unknown dtype {node['dtype']!r}")
        if not sizes[i]:
            return torch.empty(node["shape"], dtype=dtype)
        raw = torch.frombuffer(bytearray(view[offsets[i] : offsets[i] + sizes[i]]), dtype=torch.uint8)
        return raw.view(dtype).reshape(node["shape"])

    def build(node: Any) -> Any:
        if isinstance(node, list):
            return [build(v) for v in node]
        if not isinstance(node, dict):
            return node
        tag = node.get(_TAG)
        if tag is None:
            return {k: build(v) for k, v in node.items()}
        if tag == "tensor":
            return tensor(node)
        if tag == "float":
            return float(node["v"])
        if tag == "tuple":
            return tuple(build(v) for v in node["items"])
        if tag == "map":
            return {_hashable(build(k)): build(v) for k, v in node["items"]}
        if tag in ("task", "reply"):
            cls = Task if tag == "task" else Reply
            return cls(**{k: build(v) for k, v in node["fields"].items()})
        raise MessageError(f"unknown tag {tag!r}")

    return build(tree)


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def _plain(obj: Any) -> Any:
    """Tasks and replies as tagged dicts of their fields (shallow: field values stay as they are)."""
    if isinstance(obj, (Task, Reply)):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return {_TAG: "task" if isinstance(obj, Task) else "reply", "fields": fields}
    return obj


def _to_json_tagged(value: Any, buffers: list[Tensor]) -> Any:
    # Tagged task/reply dicts pass through _to_json's map branch; give them their own shape instead.
    if isinstance(value, dict) and value.get(_TAG) in ("task", "reply"):
        return {_TAG: value[_TAG], "fields": {k: _to_json(v, buffers) for k, v in value["fields"].items()}}
    return _to_json(value, buffers)
