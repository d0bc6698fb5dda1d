"""What a rank receives is checked before it is trusted: sizes before the receive buffer, answers before use.

No process group: ``dist.send``/``recv`` and ``rank_wire.recv`` are replaced by what a (broken or hostile) rank
would send. The real gloo path is run by ``test_distributed.py``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch

from fl_lightning.engines import distributed, rank_wire
from fl_lightning.engines.distributed import DistributedTransport, RankError
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import MessageError, Reply, Task


class Wire:
    """``dist.send``/``isend``/``recv`` between two fake ranks: each sent tensor is queued (copied), and each
    ``recv`` takes the next one, which must have the receiving tensor's size (as gloo requires)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.queue: list[torch.Tensor] = []
        self.sent: list[torch.Tensor] = []  # the tensors handed to send/isend themselves
        self.allocated: list[int] = []  # sizes of the uint8 buffers the receiver allocates with torch.empty
        empty = torch.empty

        def counting_empty(n: Any, **kw: Any) -> torch.Tensor:
            if kw.get("dtype") is torch.uint8:
                self.allocated.append(n)
            return empty(n, **kw)

        monkeypatch.setattr(rank_wire.dist, "send", self.send)
        monkeypatch.setattr(rank_wire.dist, "isend", lambda tensor, dst: self.send(tensor, dst) or _Done())
        monkeypatch.setattr(rank_wire.dist, "recv", self.recv)
        monkeypatch.setattr(rank_wire.torch, "empty", counting_empty)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.sent.append(tensor)
        self.queue.append(tensor.clone())

    def put(self, *tensors: torch.Tensor) -> None:
        """What a hostile rank sends."""
        self.queue.extend(tensors)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        got = self.queue.pop(0)
        assert got.dtype == tensor.dtype and got.numel() == tensor.numel(), (got, tensor.shape)
        tensor.copy_(got.reshape(tensor.shape))


def longs(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("total", [-1, 0, 11, protocol.MAX_BYTES + 1, 2**62])
def test_an_impossible_announced_length_is_refused_before_anything_is_allocated(monkeypatch, total):
    wire = Wire(monkeypatch)
    wire.put(longs(total, 1))
    with pytest.raises(MessageError, match=f"rank 3 announced a message of {total} bytes"):
        rank_wire.recv(3)
    assert wire.allocated == []


@pytest.mark.parametrize("count", [-1, 0, 101, rank_wire.MAX_PARTS + 1, 2**62])
def test_an_impossible_number_of_parts_is_refused_before_their_sizes_are_received(monkeypatch, count):
    wire = Wire(monkeypatch)
    wire.put(longs(100, count))
    with pytest.raises(MessageError, match=f"rank 1 announced {count} parts for a message of 100 bytes"):
        rank_wire.recv(1)
    assert wire.allocated == [] and wire.queue == []


@pytest.mark.parametrize("sizes", [(50, 49), (50, 51), (100, 0), (101, -1)])
def test_parts_that_do_not_make_up_the_message_are_refused_before_its_buffer_is_allocated(monkeypatch, sizes):
    wire = Wire(monkeypatch)
    wire.put(longs(100, 2), longs(*sizes))
    with pytest.raises(MessageError, match="rank 2 announced parts that are empty or do not add up to its 100"):
        rank_wire.recv(2)
    assert wire.allocated == []


def test_a_message_arrives_whole_with_its_large_tensors_sent_from_their_own_memory(monkeypatch):
    wire = Wire(monkeypatch)
    big = torch.arange(rank_wire.JOIN_BELOW, dtype=torch.float32)  # 4 × JOIN_BELOW bytes: sent as it is
    small = {f"b{i}": torch.full((3,), float(i)) for i in range(5)}  # joined with the header
    message = {"op": "tasks", "w": big, **small, "empty": torch.zeros(0), "mask": torch.tensor([True, False])}
    sending = rank_wire.send(message, 1)
    sending.wait()
    total, count = wire.sent[0].tolist()
    parts = wire.sent[2:]
    assert total == len(protocol.encode(message)) and count == len(parts) == 3  # header+small, big, small
    assert wire.sent[1].tolist() == [p.numel() for p in parts]
    assert parts[1].data_ptr() == big.data_ptr()  # no copy of the large tensor
    received, size = rank_wire.recv(0)
    assert size == total and wire.allocated == [total] and wire.queue == []
    assert received.keys() == message.keys()
    for key, value in message.items():
        assert value == received[key] if isinstance(value, str) else torch.equal(value, received[key])


def test_a_well_formed_message_is_received_and_a_malformed_one_names_its_rank(monkeypatch):
    wire = Wire(monkeypatch)
    data = protocol.encode({"op": "tasks", "tasks": [Task("fit", 0, "c0", state={"w": torch.ones(2)})]})
    wire.put(longs(len(data), 1), longs(len(data)), torch.frombuffer(bytearray(data), dtype=torch.uint8))
    message, size = rank_wire.recv(0)
    assert size == len(data) and torch.equal(message["tasks"][0].state["w"], torch.ones(2))
    broken = data.replace(b'"float32"', b'"qint8"\x20\x20')  # same length, a dtype no message carries
    wire.put(longs(len(broken), 1), longs(len(broken)), torch.frombuffer(bytearray(broken), dtype=torch.uint8))
    with pytest.raises(MessageError, match=r"rank 2 sent a malformed message: .*dtype 'qint8'"):
        rank_wire.recv(2)


def test_tasks_sharing_a_state_send_it_once_and_get_it_back_shared():
    shared, other = {"w": torch.ones(3)}, {"w": torch.zeros(3)}
    tasks = [
        Task("fit", 1, "c0", state=shared),
        Task("fit", 1, "c1", state=other),
        Task("fit", 1, "c2", state=shared),
        Task("query", 1, "c3", query="num_samples"),
    ]
    packed = rank_wire.pack_tasks(tasks)
    assert packed["state_of"] == [0, 1, 0, -1] and len(packed["states"]) == 2
    assert all(t.state is None for t in packed["tasks"]) and tasks[0].state is shared  # the tasks are not changed
    encoded = protocol.encode(packed)
    assert len(encoded) < len(protocol.encode({"op": "tasks", "tasks": tasks}))
    unpacked = rank_wire.unpack_tasks(protocol.decode(encoded))
    assert [t.client_id for t in unpacked] == ["c0", "c1", "c2", "c3"]
    assert unpacked[0].state is unpacked[2].state and torch.equal(unpacked[1].state["w"], torch.zeros(3))
    assert unpacked[3].state is None and unpacked[3].query == "num_samples"
    assert [dataclasses.replace(t, state=None) for t in unpacked] == packed["tasks"]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tasks": "fit"}, "something other than a list of tasks"),
        ({"tasks": [Reply("c0")]}, "something other than a list of tasks"),
        ({"tasks": [Task("fit", 0, "c0", state={})]}, "something other than a list of tasks"),  # states go apart
        ({"states": [[1]]}, "states that are not a list of dicts"),
        ({"states": None}, "states that are not a list of dicts"),
        ({"state_of": [1]}, "which state each of its 1 tasks has with \\[1\\]"),
        ({"state_of": [-2]}, "which state each of its 1 tasks"),
        ({"state_of": [0, 0]}, "which state each of its 1 tasks"),
        ({"state_of": [True]}, "which state each of its 1 tasks"),
        ({"state_of": None}, "which state each of its 1 tasks"),
    ],
)
def test_a_tasks_message_that_rank_0_never_sends_is_refused(fields, match):
    message = {**rank_wire.pack_tasks([Task("fit", 0, "c0")]), **fields}
    with pytest.raises(MessageError, match=match):
        rank_wire.unpack_tasks(message)


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (["op", "tasks"], "rank 0 sent no known operation"),
        ({"op": "exec"}, "rank 0 sent no known operation"),
        ({"op": None}, "no known operation"),
    ],
)
def test_a_request_that_rank_0_never_sends_is_refused(message, match):
    with pytest.raises(MessageError, match=match):
        distributed._request_op(message)


def test_the_requests_rank_0_sends_are_accepted():
    for op in ("prepare", "start", "state", "load", "stop"):
        assert distributed._request_op({"op": op}) == op
    assert distributed._request_op(rank_wire.pack_tasks([Task("fit", 0, "c0")])) == "tasks"


def transport_answering(monkeypatch: pytest.MonkeyPatch, answer: Any) -> DistributedTransport:
    transport = DistributedTransport(runtime=None, owner={"c0": 0, "c1": 1}, world_size=2)  # type: ignore[arg-type]
    monkeypatch.setattr(rank_wire, "recv", lambda src: (answer, 100))
    return transport


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ([1, 2], "rank 1 answered with a list, not a dict"),
        (None, "rank 1 answered with a NoneType"),
        ({"error": 7}, "rank 1's answer has no 'error' of type str"),
    ],
)
def test_an_answer_that_is_no_answer_names_its_rank(monkeypatch, answer, match):
    with pytest.raises(MessageError, match=match):
        transport_answering(monkeypatch, answer)._collect(1)


def test_a_ranks_reported_failure_is_a_rank_error(monkeypatch):
    with pytest.raises(RankError, match="rank 1 failed:\nTraceback"):
        transport_answering(monkeypatch, {"error": "Traceback ..."})._collect(1)


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ({"seconds": 1.0}, "rank 1's answer has no 'replies' of type list"),
        ({"replies": "x", "seconds": 1.0}, "has no 'replies' of type list"),
        ({"replies": [], "seconds": 1.0}, r"rank 1 answered 1 tasks with \[\]"),
        ({"replies": [{"client_id": "c1"}], "seconds": 1.0}, "rank 1 answered 1 tasks with"),
        ({"replies": [Reply("c1"), Reply("c1")], "seconds": 1.0}, "rank 1 answered 1 tasks"),
        ({"replies": [Reply("c1")], "seconds": "1"}, "has no 'seconds' of type float or int"),
    ],
)
def test_replies_of_the_wrong_shape_are_refused_naming_the_rank(monkeypatch, answer, match):
    transport = transport_answering(monkeypatch, answer)
    monkeypatch.setattr(transport, "_post", lambda rank, message: None)
    with pytest.raises(MessageError, match=match):
        list(transport.stream([Task(protocol.FIT, 0, "c1")]))


def test_a_ranks_runtime_state_must_be_a_dict(monkeypatch):
    transport = transport_answering(monkeypatch, {"state": [1]})
    monkeypatch.setattr(transport, "_post", lambda rank, message: type("Done", (), {"wait": lambda self: None})())
    transport.runtime = type("Runtime", (), {"state_dict": lambda self: {}})()
    with pytest.raises(MessageError, match="rank 1's answer has no 'state' of type dict"):
        transport.runtime_state()


class _Done:
    def wait(self) -> None:
        pass


class _OwnClients:
    """Rank 0's runtime: its client finishes only once rank 1's answer has been received."""

    def __init__(self, received: threading.Event) -> None:
        self.received = received

    def handle_many(self, tasks: list[Task]) -> list[Reply]:
        assert self.received.wait(10), "rank 1's answer was not received while rank 0 handled its own client"
        return [Reply(t.client_id, num_samples=1) for t in tasks]


def two_rank_transport(monkeypatch: pytest.MonkeyPatch, recv: Any) -> DistributedTransport:
    received = threading.Event()
    transport = DistributedTransport(_OwnClients(received), {"c0": 0, "c1": 1}, 2)  # type: ignore[arg-type]
    monkeypatch.setattr(transport, "_post", lambda rank, message: _Done())

    def receiving(src: int) -> tuple[Any, int]:
        try:
            return recv(src), 100
        finally:
            received.set()

    monkeypatch.setattr(rank_wire, "recv", receiving)
    return transport


def test_another_ranks_answer_is_received_while_rank_zero_handles_its_own_clients(monkeypatch):
    answer = {"replies": [Reply("c1", num_samples=2)], "seconds": 0.5}
    transport = two_rank_transport(monkeypatch, lambda src: answer)
    replies = list(transport.stream([Task(protocol.FIT, 0, "c0"), Task(protocol.FIT, 0, "c1")]))
    assert [(r.client_id, r.num_samples) for r in replies] == [("c0", 1), ("c1", 2)]  # in the order of the tasks


def test_an_answer_that_fails_in_the_background_is_raised_naming_the_rank(monkeypatch):
    def dead(src: int) -> Any:
        raise RuntimeError("Connection closed by peer")

    transport = two_rank_transport(monkeypatch, dead)
    with pytest.raises(RankError, match="rank 1 did not answer .*Connection closed by peer"):
        list(transport.stream([Task(protocol.FIT, 0, "c0"), Task(protocol.FIT, 0, "c1")]))
