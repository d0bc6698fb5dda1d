"""The messages that cross the client/server boundary, and their byte encoding (which never unpickles).

A :class:`Task` goes from the server to one client: ``fit``, ``evaluate``, a named callback ``query``, ``stats``
(federated statistics of its data), or one
of the runtime's own operations (``regroup``, ``take_private``, ``put_private``). A :class:`Reply` comes back.
Both hold only plain data: tensors, numbers, strings, booleans, ``None``, lists, tuples and dicts.

The encoding is a JSON header describing the structure (tensors by dtype, shape and byte offset) followed by
the raw tensor bytes. Decoding parses JSON and copies bytes into fresh tensors: nothing is unpickled, so a
message from the network can at worst be malformed (a clear error), never run code. :func:`decode` checks
every part of the header (node kinds and fields, dtypes of :data:`DTYPES`, shapes against their buffers, size
and nesting limits) before it acts on it, so any malformed or hostile message is a :class:`MessageError` and
its tensors never take more bytes than the message itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

MAGIC = b"FLM1"
PREFIX = len(MAGIC) + 8  # magic, then the header's length as a little-endian uint64
_TAG = "__fl__"  # key of tagged JSON objects (tensors, tuples, dicts with non-string keys, non-finite floats)

# Limits of what decode() accepts (its keyword arguments override them). A message's bytes are in memory already
# when it is decoded, and its tensors never take more than that again; the limits refuse what no run sends. The
# largest messages are runtime states (every hosted client's private and optimiser states, e.g. a distributed
# rank's or a Flower site's state file), which may pass 4 GiB on a big simulation: hence 16 GiB.
MAX_BYTES = 16 * 2**30
MAX_HEADER_BYTES = 64 * 2**20  # the JSON structure: ~100 bytes per tensor, plus plain payloads (parsed in Python)
# Parsed JSON costs far more than its bytes (an empty object: 2 bytes, a 64-byte dict; 8 MiB of them took 400 MB):
# the header's nodes are counted before it is parsed, and may number this many plus one per HEADER_NODE_BYTES bytes
# of tensor data. A model state's header has ~10 nodes per tensor (a DenseNet-121 state: ~6,000; a rank's runtime
# state of 1,000 FedBN clients with optimiser states: ~250,000); at most ~100 MB of parsed header beyond the data.
MAX_HEADER_NODES = 2**20
HEADER_NODE_BYTES = 64
MAX_DEPTH = 64  # nesting of lists, dicts, tuples and messages (a relayed task inside a payload is ~10 deep)
MAX_DIMS = 64  # dimensions of one tensor
_MAX_ELEMENTS = 2**62  # a shape's dimensions (zeros counted as ones) must multiply below torch's int64 strides

# The dtypes a message carries (model states, RNG states, sample indices, masks); nothing quantised or float8.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
              torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)
}  # fmt: skip

FIT, EVALUATE, QUERY, STATS = "fit", "evaluate", "query", "stats"
REGROUP, TAKE_PRIVATE, PUT_PRIVATE, KEEP = "regroup", "take_private", "put_private", "keep"
KINDS = (FIT, EVALUATE, QUERY, STATS, REGROUP, TAKE_PRIVATE, PUT_PRIVATE, KEEP)
# ``stats``: the client's released summaries of its data (federated statistics, fl_lightning.runtime.site_stats)
# over each of these splits, in this order (the server reads a reply's entries by these names)
STATS_SPLITS = ("train", "val", "test")
# ``keep``: the client copies its private states (every group's) to groups named KEPT + the group's name, replacing
# an earlier copy: the best validation round's personal models, which the final test evaluates (federation.select).
KEPT = "@best/"
# an evaluation reply's entry beside its models: how many rounds ago the client's personal model was trained
ROUNDS_OLD = "personal_rounds_old"
POOLED = "__pooled__"  # the client id of centralised training's single pseudo-client (all clients' data pooled)


@dataclass
class Task:
    """What the server asks of one client.

    Attributes:
        kind: ``fit``, ``evaluate``, ``query``, ``stats`` or a runtime operation (see module docstring).
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


_ALLOWED_DTYPES = frozenset(DTYPES.values())
_SCALARS = frozenset({str, int, float, bool, type(None)})  # the JSON leaves, as json.loads returns them
_NON_FINITE = frozenset({"inf", "-inf", "nan"})  # repr() of the floats JSON cannot hold
# Tagged nodes of the header and their keys (exactly these).
_TAGGED: dict[str, frozenset[str]] = {
    tag: frozenset({_TAG, *keys})
    for tag, keys in {"tensor": ("i", "dtype", "shape"), "float": ("v",), "tuple": ("items",), "map": ("items",),
                      "task": ("fields",), "reply": ("fields",)}.items()
}  # fmt: skip
_NONE = type(None)
# The types a decoded task's or reply's fields may have (the dataclasses' annotations; ints may stand for floats).
_FIELD_TYPES: dict[type, dict[str, tuple[type, ...]]] = {
    Task: {"kind": (str,), "round": (int,), "client_id": (str,), "group": (str,), "state": (dict, _NONE),
           "epochs": (int,), "steps": (int, _NONE), "lr_factor": (float, int), "subset": (Tensor, _NONE),
           "query": (str,), "options": (dict,), "payloads": (dict,)},
    Reply: {"client_id": (str,), "group": (str,), "state": (dict, _NONE), "num_samples": (int,), "num_steps": (int,),
            "metrics": (dict,), "payloads": (dict,), "error": (str, _NONE)},
}  # fmt: skip
_MISSING = dataclasses.MISSING
_REQUIRED = {  # the fields without a default
    cls: frozenset(f.name for f in dataclasses.fields(cls) if f.default is _MISSING and f.default_factory is _MISSING)
    for cls in (Task, Reply)
}


# ---------------------------------------------------------------------------------------------------- encoding
def _to_json(value: Any, buffers: list[Tensor]) -> Any:
    if isinstance(value, Tensor):
        t = value.detach()  # left where it is: counting bytes (encoded_size) needs no copy off a GPU
        if t.dtype not in _ALLOWED_DTYPES:  # refused here rather than by the receiver's decode
            raise TypeError(f"cannot encode a {t.dtype} tensor in a message (dtypes: {', '.join(DTYPES)})")
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
    head, buffers = encode_parts(obj)
    return b"".join([head, *(b.numpy() for b in buffers)])  # join copies each tensor once


def encode_parts(obj: Any) -> tuple[bytes, list[Tensor]]:
    """:func:`encode` in pieces, for a transport that sends tensors as they are: ``(head, buffers)``.

    ``head`` is the magic, header length and JSON header; ``buffers`` are the tensors' bytes in order, as flat
    uint8 CPU tensors (views of contiguous CPU tensors, so no copy; empty tensors are left out). ``head``
    followed by every buffer's bytes is exactly ``encode(obj)``.
    """
    header, tensors = _header(_plain(obj))
    buffers = [t.cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    return MAGIC + struct.pack("<Q", len(header)) + header, buffers


def encoded_size(obj: Any) -> int:
    """``len(encode(obj))`` without copying any tensor data (the in-process transport's communication count)."""
    header, buffers = _header(_plain(obj))
    return PREFIX + len(header) + sum(t.numel() * t.element_size() for t in buffers)


# ---------------------------------------------------------------------------------------------------- decoding
def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = MAX_BYTES,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_depth: int = MAX_DEPTH,
    max_header_nodes: int = MAX_HEADER_NODES,
) -> Any:
    """Bytes from :func:`encode` → the same plain data (a :class:`Task`/:class:`Reply` comes back as one).

    The bytes may come from another process or the network, so everything is checked before it is used: the
    prefix, header length and the number of JSON nodes the header can hold (a count of its ``{``, ``[`` and ``,``,
    so the parse's memory is bounded by the message's size), then the buffer sizes against the message's length
    before any tensor is built; then, node
    by node, known node kinds with exactly their fields, task and reply fields of the right types, dtypes of
    :data:`DTYPES` only, and a shape that fits its buffer exactly before that tensor is allocated. A buffer backs
    at most one tensor, and every buffer must back one. So the tensors built, even by a decode that fails
    midway, never hold more than the message's own buffer bytes.

    Args:
        data: The message.
        max_bytes: The largest message accepted (:data:`MAX_BYTES`).
        max_header_bytes: The largest JSON header accepted (:data:`MAX_HEADER_BYTES`).
        max_depth: The deepest nesting of lists, dicts, tuples and messages accepted (:data:`MAX_DEPTH`).
        max_header_nodes: The JSON nodes a header may hold beyond one per :data:`HEADER_NODE_BYTES` bytes of the
            message's tensor data (:data:`MAX_HEADER_NODES`).

    Raises:
        MessageError: If ``data`` is not a complete, well-formed message within these limits; the error says
            what is wrong, and where in the tree.

    """
    view = _byte_view(data)
    if len(view) > max_bytes:
        raise MessageError(f"message of {len(view)} bytes exceeds the limit of {max_bytes} bytes")
    if len(view) < PREFIX or view[: len(MAGIC)] != MAGIC:
        raise MessageError("not an fl_lightning message (bad magic or too short)")
    (n,) = struct.unpack("<Q", view[len(MAGIC) : PREFIX])
    if n > len(view) - PREFIX:
        raise MessageError(f"header length {n} runs past the message ({len(view) - PREFIX} bytes after the prefix)")
    if n > max_header_bytes:
        raise MessageError(f"header of {n} bytes exceeds the limit of {max_header_bytes} bytes")
    header = bytes(view[PREFIX : PREFIX + n])
    _check_node_count(header, len(view) - PREFIX - n, max_header_nodes)
    tree, sizes = _parse_header(header)
    offsets = list(itertools.accumulate(sizes, initial=PREFIX + n))
    if offsets[-1] != len(view):
        raise MessageError(f"message length {len(view)} does not match its header ({offsets[-1]})")
    decoder = _Decoder(view, sizes, offsets, max_depth)
    try:
        out = decoder.build(tree, 1)
    except _Bad as bad:
        raise MessageError(str(bad)) from None
    except RecursionError:  # only with a max_depth beyond the interpreter's stack
        raise MessageError(f"message nested too deeply for this interpreter (max_depth={max_depth})") from None
    unused = [i for i, used in enumerate(decoder.used) if not used]
    if unused:
        raise MessageError(f"buffers {unused[:10]} are referenced by no tensor")
    return out


def decode_task(data: bytes | bytearray | memoryview) -> Task:
    """:func:`decode` of what must be a :class:`Task` (a client's side of the wire).

    Raises:
        MessageError: If ``data`` is not a well-formed message, or holds something else than a task.
    """
    task = decode(data)
    if not isinstance(task, Task):
        raise MessageError(f"expected a task, got {type(task).__name__}")
    return task


def _byte_view(data: Any) -> memoryview:
    """``data`` as a flat memoryview of bytes (bytes, bytearray or a contiguous memoryview only)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"a message is bytes, not {type(data).__name__}")
    try:
        return memoryview(data).cast("B")
    except (TypeError, ValueError) as err:  # a non-contiguous or oddly shaped memoryview
        raise MessageError(f"a message is a contiguous byte buffer: {err}") from None


def _reject_constant(name: str) -> None:
    # json.loads accepts NaN/Infinity literals; encode never writes them (non-finite floats are tagged).
    raise MessageError(f"non-standard JSON constant {name} in the header")


def _check_node_count(header: bytes, data_bytes: int, max_nodes: int) -> None:
    """Refuse a header that can hold more JSON nodes than ``max_nodes`` plus one per 64 bytes of ``data_bytes``.

    Every container opens with ``{`` or ``[`` and every value after a container's first follows a ``,``: their
    count (plus one) bounds the nodes from above (characters inside strings count too: never too few).
    """
    nodes = header.count(b"{") + header.count(b"[") + header.count(b",") + 1
    limit = max_nodes + data_bytes // HEADER_NODE_BYTES
    if nodes > limit:
        raise MessageError(
            f"header of {len(header)} bytes holds up to {nodes} JSON nodes, more than the limit of {limit} "
            f"({max_nodes} plus one per {HEADER_NODE_BYTES} bytes of the message's {data_bytes} bytes of tensor data)"
        )


def _parse_header(text: bytes) -> tuple[Any, list[int]]:
    """The header's JSON → ``(tree, sizes)``, with ``sizes`` checked (non-negative integers)."""
    try:
        head = json.loads(text.decode("utf-8"), parse_constant=_reject_constant)
    except MessageError:
        raise
    except (ValueError, RecursionError) as err:  # RecursionError: nesting deeper than the C parser's stack
        raise MessageError(f"malformed message header: {type(err).__name__}: {err}") from None
    if not isinstance(head, dict) or head.keys() != {"tree", "sizes"}:
        what = sorted(head) if isinstance(head, dict) else type(head).__name__
        raise MessageError(f"the header is an object of exactly 'tree' and 'sizes', not {what}")
    sizes = head["sizes"]
    if not isinstance(sizes, list) or not _naturals(sizes):
        bad = sizes if not isinstance(sizes, list) else next(s for s in sizes if type(s) is not int or s < 0)
        raise MessageError(f"header sizes must be a list of non-negative integers; found {bad!r}")
    return head["tree"], sizes


def _naturals(values: list[Any]) -> bool:
    """Whether every value is a non-negative int (JSON's ``true`` is no int here)."""
    return all(type(v) is int for v in values) and min(values, default=0) >= 0


class _Bad(Exception):
    """What is wrong at a node, and the path to it (filled in while the error rises through the tree)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason, self.path = reason, []

    def at(self, key: Any) -> _Bad:
        self.path.append(key)
        return self

    def __str__(self) -> str:
        keys = [f"[{k!r}]" for k in reversed(self.path)]
        if len(keys) > 24:  # deep nesting: the start and the end of the path say enough
            keys[12:-8] = [f"...({len(keys) - 20} more)..."]
        return f"tree{''.join(keys)}: {self.reason}"


class _Decoder:
    """Builds the plain data of a parsed header, checking every node; tensors are copied out of ``view``."""

    def __init__(self, view: memoryview, sizes: list[int], offsets: list[int], max_depth: int) -> None:
        self.view, self.sizes, self.offsets, self.max_depth = view, sizes, offsets, max_depth
        self.used = [False] * len(sizes)

    def build(self, node: Any, depth: int) -> Any:
        if type(node) in _SCALARS:
            return node
        if depth > self.max_depth:
            raise _Bad(f"nested deeper than {self.max_depth} levels")
        if type(node) is list:
            return self.items(node, depth)
        if _TAG not in node:  # a plain dict with string keys
            out = {}
            for key, value in node.items():
                try:
                    out[key] = self.build(value, depth + 1)
                except _Bad as bad:
                    raise bad.at(key) from None
            return out
        return self.tagged(node, depth)

    def items(self, values: list[Any], depth: int) -> list[Any]:
        out = []
        for i, value in enumerate(values):
            try:
                out.append(value if type(value) in _SCALARS else self.build(value, depth + 1))
            except _Bad as bad:
                raise bad.at(i) from None
        return out

    def tagged(self, node: dict[str, Any], depth: int) -> Any:
        tag = node[_TAG]
        fields = _TAGGED.get(tag) if type(tag) is str else None
        if fields is None:
            raise _Bad(f"unknown tag {tag!r}")
        if node.keys() != fields:
            raise _Bad(f"a {tag!r} node has exactly the keys {sorted(fields)}, not {sorted(node)}")
        if tag == "tensor":
            return self.tensor(node)
        if tag == "float":
            if type(node["v"]) is not str or node["v"] not in _NON_FINITE:  # a list is no set member: a TypeError
                raise _Bad(f"a 'float' node holds 'inf', '-inf' or 'nan', not {node['v']!r}")
            return float(node["v"])
        if tag in ("task", "reply"):
            return self.message(Task if tag == "task" else Reply, node["fields"], depth)
        items = node["items"]
        if type(items) is not list:
            raise _Bad(f"the items of a {tag!r} node are a list, not {type(items).__name__}").at("items")
        if tag == "tuple":
            try:
                return tuple(self.items(items, depth + 1))
            except _Bad as bad:
                raise bad.at("items") from None
        return self.map(items, depth)

    def map(self, items: list[Any], depth: int) -> dict[Any, Any]:
        out = {}
        for i, pair in enumerate(items):
            try:
                if type(pair) is not list or len(pair) != 2:
                    raise _Bad("a map entry is a [key, value] pair")
                key = _hashable(self._entry(pair, 0, depth + 3))
                try:
                    hash(key)
                except TypeError:
                    raise _Bad(f"map key of type {type(key).__name__} is not hashable") from None
                out[key] = self._entry(pair, 1, depth + 3)
            except _Bad as bad:
                raise bad.at(i).at("items") from None
        return out

    def _entry(self, pair: list[Any], side: int, depth: int) -> Any:
        try:
            return self.build(pair[side], depth)
        except _Bad as bad:
            raise bad.at(side) from None

    def message(self, cls: type[Task] | type[Reply], fields: Any, depth: int) -> Task | Reply:
        if type(fields) is not dict:
            raise _Bad(f"the fields of a {cls.__name__} are an object, not {type(fields).__name__}").at("fields")
        spec = _FIELD_TYPES[cls]
        unknown = sorted(set(fields) - spec.keys())
        missing = sorted(_REQUIRED[cls] - fields.keys())
        if unknown or missing:
            raise _Bad(f"a {cls.__name__} has no field {unknown}" if unknown else f"a {cls.__name__} needs {missing}")
        values = {}
        for name, raw in fields.items():
            try:
                values[name] = value = self.build(raw, depth + 2)
                _check_field(cls, name, value, spec[name])
            except _Bad as bad:
                raise bad.at(name).at("fields") from None
        return cls(**values)

    def tensor(self, node: dict[str, Any]) -> Tensor:
        i, name, shape = node["i"], node["dtype"], node["shape"]
        if type(i) is not int or not 0 <= i < len(self.sizes):
            raise _Bad(f"buffer index {i!r} is not in 0 .. {len(self.sizes) - 1}")
        if self.used[i]:
            raise _Bad(f"buffer {i} is referenced by a second tensor")
        dtype = DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            raise _Bad(f"dtype {name!r} is not one a message carries ({', '.join(DTYPES)})")
        if type(shape) is not list or len(shape) > MAX_DIMS or not _naturals(shape):
            raise _Bad(f"shape {shape!r} is not a list of at most {MAX_DIMS} non-negative integers")
        size, numel = self.sizes[i], math.prod(shape)
        if numel * dtype.itemsize != size:
            raise _Bad(f"shape {shape} of {name} needs {numel * dtype.itemsize} bytes, but buffer {i} holds {size}")
        if not numel and math.prod(max(s, 1) for s in shape) > _MAX_ELEMENTS:  # empty, but torch's strides overflow
            raise _Bad(f"shape {shape} is too large")
        self.used[i] = True
        if not size:
            return torch.empty(shape, dtype=dtype)
        start = self.offsets[i]
        raw = torch.frombuffer(bytearray(self.view[start : start + size]), dtype=torch.uint8)
        if dtype is torch.bool and bool((raw > 1).any()):  # torch assumes a bool is stored as 0 or 1
            raise _Bad(f"buffer {i} of a bool tensor holds bytes other than 0 and 1")
        return raw.view(dtype).reshape(shape)


def _check_field(cls: type, name: str, value: Any, types: tuple[type, ...]) -> None:
    """A task's or reply's field value has one of its ``types`` (a bool is no int here); a task's kind is known."""
    if not isinstance(value, types) or (type(value) is bool and bool not in types):
        allowed = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise _Bad(f"{cls.__name__}.{name} must be {allowed}, not {type(value).__name__}")
    if cls is Task and name == "kind" and value not in KINDS:
        raise _Bad(f"unknown task kind {value!r} (one of {', '.join(KINDS)})")
    if name == "state" and value is not None:
        if not all(type(k) is str and isinstance(v, Tensor) for k, v in value.items()):
            raise _Bad(f"{cls.__name__}.state maps names to tensors")


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
