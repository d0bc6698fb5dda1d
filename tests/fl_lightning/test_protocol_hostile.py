"""The wire decoder against hostile bytes: only MessageError, never more tensor bytes than the message holds.

Property-based (Hypothesis, fixed seed in the default run; the ``slow`` variants draw many more examples):
random bytes, random valid messages that must come back exactly, and valid messages mutated byte-wise or in
their JSON header. Then a corpus of hostile messages found earlier, each an explicit regression test.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import DTYPES, KINDS, MAGIC, MessageError, Reply, Task, decode, encode, encoded_size

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
FAST = settings(derandomize=True, database=None, max_examples=120, deadline=None, suppress_health_check=_HEALTH)
SLOW = settings(database=None, max_examples=3000, deadline=None, suppress_health_check=_HEALTH)


# ---------------------------------------------------------------------------------------------------- helpers
def message(head: Any, body: bytes = b"") -> bytes:
    """A message from a header (a JSON value, or raw header bytes) and its buffers' bytes."""
    text = head if isinstance(head, bytes) else json.dumps(head, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<Q", len(text)) + text + body


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A valid message → its parsed header and its buffers' bytes."""
    (n,) = struct.unpack("<Q", data[4:12])
    return json.loads(data[12 : 12 + n]), data[12 + n :]


def tensor_node(**kw: Any) -> dict[str, Any]:
    return {"__fl__": "tensor", "i": 0, "dtype": "float32", "shape": [1], **kw}


def task_node(**fields: Any) -> dict[str, Any]:
    return {"__fl__": "task", "fields": {"kind": "fit", "round": 0, "client_id": "c0", **fields}}


def tensor_bytes(value: Any) -> int:
    """Bytes held by every tensor in a decoded value."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (Task, Reply)):
        return sum(tensor_bytes(getattr(value, f)) for f in protocol._FIELD_TYPES[type(value)])
    if isinstance(value, dict):
        return sum(tensor_bytes(k) + tensor_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def buffer_bytes(data: bytes) -> int:
    """Bytes after the header: all a message's tensors may take."""
    return len(data) - 12 - struct.unpack("<Q", data[4:12])[0]


def decode_counting(data: bytes) -> tuple[Any, int]:
    """``decode(data)`` and the bytes of every tensor it built, even of a decode that raised midway."""
    built = [0]
    original = protocol._Decoder.tensor

    def counting(self: Any, node: dict[str, Any]) -> torch.Tensor:
        t = original(self, node)
        built[0] += t.numel() * t.element_size()
        return t

    with mock.patch.object(protocol._Decoder, "tensor", counting):
        try:
            return decode(data), built[0]
        except MessageError:
            return None, built[0]


def check_hostile(data: bytes) -> None:
    """The property: ``decode`` raises nothing but MessageError and builds no more tensor bytes than there are."""
    out, built = decode_counting(data)  # anything but a MessageError propagates and fails the test
    limit = max(0, len(data) - 12)
    assert built <= limit, f"{built} tensor bytes built from a {len(data)}-byte message"
    if out is not None:
        assert tensor_bytes(out) == built <= buffer_bytes(data)


def same(a: Any, b: Any) -> bool:
    """Exact equality: same types, tensors bit for bit (NaNs included), floats by their bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        bits = (t.reshape(-1).view(torch.uint8) for t in (a, b))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (Task, Reply)):
        return all(same(getattr(a, f), getattr(b, f)) for f in protocol._FIELD_TYPES[type(a)])
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------------------------------------- strategies
@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of an allowed dtype with arbitrary bit patterns (bools 0/1), shapes with zeros and 0-d ones."""
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = math.prod(shape) * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    if dtype is torch.bool:
        raw = bytes(b & 1 for b in raw)
    if not n:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | tensors()
KEYS = st.sampled_from(["__fl__", "i", "items"]) | st.text(max_size=6)
HASHABLE = st.integers() | st.booleans() | st.text(max_size=4) | st.tuples(st.integers(), st.text(max_size=3))


def plain(leaves: st.SearchStrategy = LEAVES) -> st.SearchStrategy:
    """Plain data as the project sends it: nested lists, tuples and dicts (string keys or others)."""
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.lists(inner, max_size=3).map(tuple)
            | st.dictionaries(KEYS, inner, max_size=4)
            | st.dictionaries(HASHABLE, inner, max_size=3)
        ),
        max_leaves=12,
    )


STATES = st.none() | st.dictionaries(st.text(max_size=6), tensors(), max_size=4)
MAYBE_TENSOR = st.none() | tensors()
NUMBERS = st.integers(-(2**40), 2**40)
TASKS = st.builds(
    Task, kind=st.sampled_from(KINDS), round=NUMBERS, client_id=st.text(max_size=6), group=st.text(max_size=6),
    state=STATES, epochs=NUMBERS, steps=st.none() | NUMBERS, lr_factor=st.floats() | NUMBERS,
    subset=MAYBE_TENSOR, query=st.text(max_size=6), options=st.dictionaries(KEYS, plain(), max_size=2),
    payloads=st.dictionaries(KEYS, plain(), max_size=2),
)  # fmt: skip
REPLIES = st.builds(
    Reply, client_id=st.text(max_size=6), group=st.text(max_size=6), state=STATES, num_samples=NUMBERS,
    num_steps=NUMBERS, metrics=st.dictionaries(KEYS, plain(), max_size=3),
    payloads=st.dictionaries(KEYS, plain() | TASKS, max_size=2), error=st.none() | st.text(max_size=8),
)  # fmt: skip
MESSAGES = plain() | TASKS | REPLIES | st.dictionaries(KEYS, TASKS | REPLIES, max_size=2)

# What a mutated header node may become: hostile values of every JSON type, tags and fields included.
HOSTILE_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-3, 3) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["qint8", "float8_e4m3fn", "Tensor", "inf", "nan", "1e308", "fit", "tensor", "map", "task",
                       "reply", "tuple", "float", "__fl__", "", "-1"])
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["__fl__", "i", "dtype", "shape", "items", "fields", "v", "kind", "round", "client_id",
                         "state", "evil"]) | st.text(max_size=4), inner, max_size=4),
    max_leaves=8,
)  # fmt: skip


def nodes(tree: Any) -> list[tuple[Any, Any]]:
    """Every ``(container, key)`` of a parsed JSON value, for mutating one place of it."""
    out: list[tuple[Any, Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        keys = range(len(node)) if isinstance(node, list) else list(node) if isinstance(node, dict) else ()
        for k in keys:
            out.append((node, k))
            stack.append(node[k])
    return out


@st.composite
def header_edits(draw: st.DrawFn) -> bytes:
    """A valid message whose JSON header has one place replaced, deleted or added (with a consistent prefix)."""
    head, body = split(encode(draw(MESSAGES)))
    places = nodes(head)
    container, key = draw(st.sampled_from(places))
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        container[key] = draw(HOSTILE_JSON)
    elif action == "delete":
        del container[key]
    elif isinstance(container, list):
        container.insert(draw(st.integers(0, len(container))), draw(HOSTILE_JSON))
    else:
        container[draw(st.text(max_size=6))] = draw(HOSTILE_JSON)
    if draw(st.booleans()):  # the buffers too: trimmed, extended or kept
        body = body[: draw(st.integers(0, len(body)))] + draw(st.binary(max_size=16))
    return message(head, body)


@st.composite
def byte_edits(draw: st.DrawFn) -> bytes:
    """A valid message with bytes flipped, cut off, inserted or deleted anywhere (the length prefix included)."""
    data = bytearray(encode(draw(MESSAGES)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(min(12, len(data)), len(data)) | st.integers(0, len(data)))  # mostly past the prefix
        action = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        if action == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif action == "truncate":
            del data[at:]
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


def tagged_nodes(inner: st.SearchStrategy) -> st.SearchStrategy:
    """Tagged nodes with exactly their keys (or one more, or one fewer) holding hostile values."""

    def node(tag: str, keys: frozenset[str]) -> st.SearchStrategy:
        values = {k: st.just(tag) if k == "__fl__" else inner | FIELD_VALUES for k in sorted(keys)}
        exact = st.fixed_dictionaries(values)
        return exact | st.fixed_dictionaries(values, optional={"evil": inner}) | exact.map(_drop_one)

    return st.sampled_from(sorted(protocol._TAGGED.items())).flatmap(lambda kv: node(*kv))


def _drop_one(node: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in list(node.items())[1:]} if len(node) > 1 else node


FIELD_VALUES = (
    st.integers(-2, 3)
    | st.sampled_from(["float32", "bool", "qint8", "inf", "nan", "fit", "c0"])
    | st.lists(st.integers(-1, 3), max_size=3)
    | st.fixed_dictionaries({"kind": st.sampled_from(["fit", "pwn", 3]), "round": st.integers(-1, 1) | st.none(),
                             "client_id": st.text(max_size=2) | st.none()})
)  # fmt: skip
HOSTILE_TREES = st.recursive(
    HOSTILE_JSON, lambda inner: tagged_nodes(inner) | st.lists(inner, max_size=3), max_leaves=10
)  # fmt: skip
CRAFTED = st.builds(
    lambda tree, sizes, body: message({"tree": tree, "sizes": sizes}, body),
    HOSTILE_TREES, st.lists(st.integers(-1, 16), max_size=3), st.binary(max_size=40),
)  # fmt: skip

RANDOM_BYTES = st.binary(max_size=256) | st.binary(max_size=200).map(
    lambda b: MAGIC + struct.pack("<Q", len(b) // 2) + b
)  # fmt: skip
HOSTILE = RANDOM_BYTES | byte_edits() | header_edits() | CRAFTED


# ---------------------------------------------------------------------------------------------------- properties
def check_round_trip(value: Any) -> None:
    data = encode(value)
    assert same(decode(data), value)
    assert encoded_size(value) == len(data)


@FAST
@given(MESSAGES)
def test_valid_messages_round_trip_exactly(value: Any) -> None:
    check_round_trip(value)


@settings(FAST, max_examples=500)
@given(HOSTILE)
def test_hostile_bytes_raise_only_message_error_and_allocate_no_more_than_they_hold(data: bytes) -> None:
    check_hostile(data)


@pytest.mark.slow
@SLOW
@given(MESSAGES)
def test_valid_messages_round_trip_exactly_many(value: Any) -> None:
    check_round_trip(value)


@pytest.mark.slow
@SLOW
@given(HOSTILE)
def test_hostile_bytes_many(data: bytes) -> None:
    check_hostile(data)


def test_every_single_byte_mutation_of_a_task_header_is_a_message_error_or_a_message():
    """The independent check's probe: each byte of a valid task's header set to other values in turn."""
    data = encode(Task("fit", 3, "c1", "g", state={"w": torch.ones(2, 3), "b": torch.zeros(3)}, subset=torch.arange(4)))
    n = struct.unpack("<Q", data[4:12])[0]
    for at in range(12 + n):
        for value in {0, 1, 0x22, 0x2D, 0x30, 0x39, 0x5B, 0x7B, 0xFF, data[at] ^ 0x01}:
            mutated = bytearray(data)
            mutated[at] = value
            check_hostile(bytes(mutated))


# ---------------------------------------------------------------------------------------------------- corpus
def test_the_127_byte_message_claiming_10_gb_is_refused_before_allocating():
    def claim(name: str) -> bytes:
        return message({"tree": {name: tensor_node(shape=[50000, 50000])}, "sizes": [0]})

    data = claim("w" * (1 + 127 - len(claim("w"))))
    assert len(data) == 127
    with mock.patch.object(torch, "empty", side_effect=AssertionError("allocated")):
        with pytest.raises(MessageError, match=r"shape \[50000, 50000\] of float32 needs 10000000000 bytes.*holds 0"):
            decode(data)


def test_a_negative_buffer_index_is_refused():
    data = message({"tree": [tensor_node(i=0), tensor_node(i=-1)], "sizes": [4, 4]}, bytes(8))
    with pytest.raises(MessageError, match=r"tree\[1\]: buffer index -1 is not in 0 \.\. 1"):
        decode(data)


@pytest.mark.parametrize("index", [2, 1.0, True, "0", None])
def test_a_buffer_index_out_of_range_or_not_an_int_is_refused(index):
    data = message({"tree": [tensor_node(i=0), tensor_node(i=index)], "sizes": [4, 4]}, bytes(8))
    with pytest.raises(MessageError, match="buffer index"):
        decode(data)


def test_a_buffer_used_twice_or_never_is_refused():
    with pytest.raises(MessageError, match="buffer 0 is referenced by a second tensor"):
        decode(message({"tree": [tensor_node(), tensor_node()], "sizes": [4]}, bytes(4)))
    with pytest.raises(MessageError, match=r"buffers \[1\] are referenced by no tensor"):
        decode(message({"tree": tensor_node(), "sizes": [4, 4]}, bytes(8)))


@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint32", "float8_e4m3fn", "float8_e5m2", "complex32",
                                   "uint16", "Tensor", "dtype", "float", 5, None])  # fmt: skip
def test_quantised_exotic_and_made_up_dtypes_are_refused(dtype):
    data = message({"tree": tensor_node(dtype=dtype, shape=[4]), "sizes": [4]}, bytes(4))
    with pytest.raises(MessageError, match=r"dtype .* is not one a message carries \(float16, bfloat16"):
        decode(data)


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions")
def test_encode_refuses_what_decode_would_refuse():
    with pytest.raises(TypeError, match="float8_e4m3fn tensor"):
        encode({"w": torch.zeros(2, dtype=torch.float8_e4m3fn)})
    with pytest.raises(TypeError, match="qint8 tensor"):
        encode(torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8))


def test_nesting_100000_levels_deep_is_a_message_error():
    deep = b'{"tree":' + b"[" * 100_000 + b"]" * 100_000 + b',"sizes":[]}'
    with pytest.raises(MessageError, match="malformed message header: RecursionError"):
        decode(message(deep))


def test_nesting_past_max_depth_is_refused_with_its_path():
    data = encode({"a": [[[[1]]]]})
    assert decode(data, max_depth=5) == {"a": [[[[1]]]]}  # the dict, then four lists
    with pytest.raises(MessageError, match=r"tree\['a'\]\[0\]\[0\]\[0\]: nested deeper than 4 levels"):
        decode(data, max_depth=4)
    nested: Any = 1
    for _ in range(protocol.MAX_DEPTH):
        nested = [nested]
    assert decode(encode(nested)) == nested
    nested = [nested]
    with pytest.raises(MessageError, match=f"nested deeper than {protocol.MAX_DEPTH} levels"):
        decode(encode(nested))
    deep_task = Task("query", 0, "c0", payloads={"x": Task("fit", 0, "c1", state={"w": torch.ones(1)})})
    assert isinstance(decode(encode(deep_task)).payloads["x"], Task)  # a relayed task is far from the limit


@pytest.mark.parametrize(
    ("head", "match"),
    [
        ([1, 2], r"header is an object of exactly 'tree' and 'sizes', not list"),
        ("tree", "not str"),
        ({"sizes": []}, r"not \['sizes'\]"),
        ({"tree": None, "sizes": [], "extra": 1}, r"not \['extra', 'sizes', 'tree'\]"),
        ({"tree": None, "sizes": {}}, "sizes must be a list of non-negative integers; found {}"),
        ({"tree": None, "sizes": [-4]}, "sizes must be a list of non-negative integers; found -4"),
        ({"tree": None, "sizes": [1.5]}, "found 1.5"),
        ({"tree": None, "sizes": ["4"]}, "found '4'"),
        ({"tree": None, "sizes": [True]}, "found True"),
    ],
)
def test_malformed_headers_are_refused(head, match):
    with pytest.raises(MessageError, match=match):
        decode(message(head, bytes(4)))


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b'{"tree":NaN,"sizes":[]}', "non-standard JSON constant NaN"),
        (b'{"tree":Infinity,"sizes":[]}', "non-standard JSON constant Infinity"),
        (b'{"tree":"\xff","sizes":[]}', "malformed message header: UnicodeDecodeError"),
        (b'{"tree":1', "malformed message header: JSONDecodeError"),
    ],
)
def test_header_json_that_encode_never_writes_is_refused(raw, match):
    with pytest.raises(MessageError, match=match):
        decode(message(raw))


def test_a_buffer_past_the_end_and_a_header_length_past_the_end_are_refused():
    with pytest.raises(MessageError, match=r"message length 94 does not match its header \(96\)"):
        decode(message({"tree": tensor_node(shape=[2]), "sizes": [8]}, bytes(6)))
    with pytest.raises(MessageError, match="header length 9223372036854775808 runs past the message"):
        decode(MAGIC + struct.pack("<Q", 2**63) + b'{"tree":null,"sizes":[]}')


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ([-1, -4], r"shape \[-1, -4\] is not a list of at most 64 non-negative integers"),
        ([2, -2], "non-negative integers"),
        ([2.0, 2.0], "non-negative integers"),
        ([True, 4], "non-negative integers"),
        ("ab", "non-negative integers"),
        (4, "non-negative integers"),
        ([1] * 65, "at most 64"),
        ([3], r"needs 12 bytes, but buffer 0 holds 16"),
    ],
)
def test_bad_shapes_are_refused(shape, match):
    with pytest.raises(MessageError, match=match):
        decode(message({"tree": tensor_node(shape=shape), "sizes": [16]}, bytes(16)))


def test_an_empty_shape_whose_strides_overflow_is_refused():
    with pytest.raises(MessageError, match=r"shape \[0, 4611686018427387904, 4611686018427387904\] is too large"):
        decode(message({"tree": tensor_node(shape=[0, 2**62, 2**62]), "sizes": [0]}))


def test_bool_buffers_hold_only_zeros_and_ones():
    with pytest.raises(MessageError, match="bool tensor holds bytes other than 0 and 1"):
        decode(message({"tree": tensor_node(dtype="bool", shape=[2]), "sizes": [2]}, b"\x01\x07"))


@pytest.mark.parametrize(
    ("tree", "match"),
    [
        (task_node(evil=1), r"tree: a Task has no field \['evil'\]"),
        ({"__fl__": "task", "fields": {"kind": "fit", "round": 0}}, r"a Task needs \['client_id'\]"),
        ({"__fl__": "reply", "fields": {"client_id": "c0", "kind": "fit"}}, r"a Reply has no field \['kind'\]"),
        (task_node(round="0"), r"tree\['fields'\]\['round'\]: Task.round must be int, not str"),
        (task_node(round=True), "Task.round must be int, not bool"),
        (task_node(round=1.0), "Task.round must be int, not float"),
        (task_node(client_id=7), "Task.client_id must be str, not int"),
        (task_node(kind="rm -rf"), "unknown task kind 'rm -rf'"),
        (task_node(steps="3"), "Task.steps must be int or None, not str"),
        (task_node(lr_factor="1"), "Task.lr_factor must be float or int, not str"),
        (task_node(options=[]), "Task.options must be dict, not list"),
        (task_node(state={"w": 1.0}), "Task.state maps names to tensors"),
        (task_node(subset=[0, 1]), "Task.subset must be Tensor or None, not list"),
        ({"__fl__": "reply", "fields": {"client_id": "c0", "num_samples": "9"}}, "Reply.num_samples must be int"),
        ({"__fl__": "reply", "fields": {"client_id": "c0", "error": 1}}, "Reply.error must be str or None"),
        ({"__fl__": "task", "fields": []}, r"tree\['fields'\]: the fields of a Task are an object, not list"),
        ({"__fl__": "task", "fields": {}, "x": 1}, r"a 'task' node has exactly the keys \['__fl__', 'fields'\]"),
        ({"a": [{"__fl__": "pickle"}]}, r"tree\['a'\]\[0\]: unknown tag 'pickle'"),
        ({"__fl__": None}, "unknown tag None"),
        ({"__fl__": ["tensor"]}, r"unknown tag \['tensor'\]"),
        ({"__fl__": "float", "v": "1e308"}, "a 'float' node holds 'inf', '-inf' or 'nan', not '1e308'"),
        ({"__fl__": "float", "v": 1.5}, "not 1.5"),
        ({"__fl__": "float", "v": []}, r"not \[\]"),
        ({"__fl__": "float", "v": {}}, "not {}"),
        ({"__fl__": "tuple", "items": {}}, r"tree\['items'\]: the items of a 'tuple' node are a list, not dict"),
        ({"__fl__": "map", "items": [[1]]}, r"tree\['items'\]\[0\]: a map entry is a \[key, value\] pair"),
        ({"__fl__": "map", "items": [[{"a": 1}, 2]]}, r"tree\['items'\]\[0\]: map key of type dict is not hashable"),
        ({"__fl__": "map", "items": [[[[1]], 2]]}, "map key of type tuple is not hashable"),
        ({"__fl__": "map", "items": [[1, {"__fl__": "x"}]]}, r"tree\['items'\]\[0\]\[1\]: unknown tag 'x'"),
        (task_node(payloads={"X": {"__fl__": "reply", "fields": {"client_id": 3}}}),
         r"tree\['fields'\]\['payloads'\]\['X'\]\['fields'\]\['client_id'\]: Reply.client_id must be str"),
        (tensor_node(extra=1), r"a 'tensor' node has exactly the keys \['__fl__', 'dtype', 'i', 'shape'\]"),
    ],
)  # fmt: skip
def test_bad_nodes_are_refused_naming_where(tree, match):
    with pytest.raises(MessageError, match=match):
        decode(message({"tree": tree, "sizes": [4]}, bytes(4)))  # refused before the unused buffer is noticed


@pytest.mark.parametrize("data", ["FLM1", None, 12, [b"FLM1"], torch.zeros(3, dtype=torch.uint8)])
def test_data_that_is_not_bytes_is_refused(data):
    with pytest.raises(MessageError, match="a message is bytes, not"):
        decode(data)


def test_bytearray_and_memoryview_messages_decode_and_odd_views_are_refused():
    data = encode({"w": torch.arange(3.0)})
    for form in (bytearray(data), memoryview(data), memoryview(bytearray(data))):
        assert torch.equal(decode(form)["w"], torch.arange(3.0))
    with pytest.raises(MessageError, match="contiguous byte buffer"):
        decode(memoryview(data * 2)[::2])


def test_the_size_limits_are_keyword_arguments_with_documented_defaults():
    data = encode({"w": torch.zeros(100)})
    assert protocol.MAX_BYTES >= 4 * 2**30 and protocol.MAX_HEADER_BYTES >= 2**20 and protocol.MAX_DEPTH >= 32
    assert protocol.MAX_HEADER_NODES >= 2**20
    with pytest.raises(MessageError, match=f"message of {len(data)} bytes exceeds the limit of 100 bytes"):
        decode(data, max_bytes=100)
    with pytest.raises(MessageError, match="exceeds the limit of 10 bytes"):
        decode(data, max_header_bytes=10)
    assert torch.equal(decode(data, max_bytes=len(data))["w"], torch.zeros(100))


def _raw_message(tree: Any, sizes: list[int] = (), data: bytes = b"") -> bytes:
    header = json.dumps({"tree": tree, "sizes": list(sizes)}, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<Q", len(header)) + header + data


def test_a_header_of_many_empty_objects_is_refused_before_it_is_parsed():
    """Failed before: 8 MiB of empty objects cost ~400 MB to parse, a 60 MiB header killed the process."""
    data = _raw_message([{} for _ in range(3_000_000)])  # 9 MiB, well under the header's byte limit
    assert len(data) < protocol.MAX_HEADER_BYTES
    with mock.patch.object(protocol.json, "loads", side_effect=AssertionError("parsed")):
        with pytest.raises(MessageError, match=r"holds up to 6000004 JSON nodes, more than the limit of 1048576"):
            decode(data)


def test_the_node_limit_grows_with_the_tensor_data_and_is_a_keyword_argument():
    n = 2000
    tree = {"w": [{"__fl__": "tensor", "i": i, "dtype": "float32", "shape": [16]} for i in range(n)]}
    data = _raw_message(tree, [64] * n, bytes(64 * n))
    header = json.dumps({"tree": tree, "sizes": [64] * n}, separators=(",", ":"))
    nodes = sum(header.count(c) for c in "{[,") + 1  # an upper bound of the JSON values in it
    assert len(decode(data)["w"]) == n
    with pytest.raises(MessageError, match="JSON nodes"):
        decode(data, max_header_nodes=nodes - n - 1)  # one node per 64 bytes of data: n of them
    assert len(decode(data, max_header_nodes=nodes - n)["w"]) == n
    state = {f"layer{i}.weight": torch.zeros(3) for i in range(20_000)}  # 20,000 tiny tensors: a real state
    assert decode(encode(state)).keys() == state.keys()


def test_the_field_type_table_covers_every_task_and_reply_field():
    import dataclasses

    for cls in (Task, Reply):
        assert list(protocol._FIELD_TYPES[cls]) == [f.name for f in dataclasses.fields(cls)]


def test_encode_output_is_unchanged_byte_for_byte():
    """The encoding of the original decoder's era: other tests and rounds.csv count these bytes."""
    task = Task("fit", 1, "c0", "g", state={"w": torch.arange(3, dtype=torch.float32)}, subset=torch.tensor([0, 2]),
                payloads={"X": (1, float("inf")), "M": {2: "two"}})  # fmt: skip
    header = (
        b'{"tree":{"__fl__":"task","fields":{"kind":"fit","round":1,"client_id":"c0","group":"g","state":{"w":'
        b'{"__fl__":"tensor","i":0,"dtype":"float32","shape":[3]}},"epochs":1,"steps":null,"lr_factor":1.0,"subset":'
        b'{"__fl__":"tensor","i":1,"dtype":"int64","shape":[2]},"query":"","options":{},"payloads":{"X":{"__fl__":'
        b'"tuple","items":[1,{"__fl__":"float","v":"inf"}]},"M":{"__fl__":"map","items":[[2,"two"]]}}}},'
        b'"sizes":[12,16]}'
    )
    body = struct.pack("<3f", 0, 1, 2) + struct.pack("<2q", 0, 2)
    assert encode(task) == MAGIC + struct.pack("<Q", len(header)) + header + body
    assert encoded_size(task) == 460
