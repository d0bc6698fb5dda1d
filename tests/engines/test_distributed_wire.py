"""What a rank receives is checked before it is trusted: sizes before the receive buffer, answers before use.

No process group: ``dist.recv`` and ``_recv`` are replaced by what a broken or hostile rank would send.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from fl_lightning.engines import distributed
from fl_lightning.engines.distributed import DistributedTransport, RankError
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import MessageError, Reply, Task


def wire(monkeypatch: pytest.MonkeyPatch, size: int, body: bytes = b"") -> list[int]:
    """``dist.recv`` fills the size tensor with ``size``, then the data tensor with ``body``; returns the sizes
    of the data buffers allocated by ``torch.empty``."""
    allocated: list[int] = []
    empty = torch.empty

    def recv(tensor: torch.Tensor, src: int) -> None:
        if tensor.dtype == torch.int64:
            tensor[0] = size
        else:
            tensor.copy_(torch.frombuffer(bytearray(body), dtype=torch.uint8))

    def counting_empty(n: int, **kw: Any) -> torch.Tensor:
        allocated.append(n)
        return empty(n, **kw)

    monkeypatch.setattr(distributed.dist, "recv", recv)
    monkeypatch.setattr(distributed.torch, "empty", counting_empty)
    return allocated


@pytest.mark.parametrize("size", [-1, 0, 11, protocol.MAX_BYTES + 1, 2**62])
def test_an_impossible_announced_size_is_refused_before_the_buffer_is_allocated(monkeypatch, size):
    allocated = wire(monkeypatch, size)
    with pytest.raises(MessageError, match=f"rank 3 announced a message of {size} bytes"):
        distributed._recv(3)
    assert allocated == []


def test_a_well_formed_message_is_received_and_a_malformed_one_names_its_rank(monkeypatch):
    data = protocol.encode({"op": "tasks", "tasks": [Task("fit", 0, "c0", state={"w": torch.ones(2)})]})
    allocated = wire(monkeypatch, len(data), data)
    message, size = distributed._recv(0)
    assert allocated == [len(data)] and size == len(data) and torch.equal(message["tasks"][0].state["w"], torch.ones(2))
    broken = data.replace(b'"float32"', b'"qint8"\x20\x20')  # same length, a dtype no message carries
    wire(monkeypatch, len(broken), broken)
    with pytest.raises(MessageError, match=r"rank 2 sent a malformed message: .*dtype 'qint8'"):
        distributed._recv(2)


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (["op", "tasks"], "rank 0 sent no known operation"),
        ({"op": "exec"}, "rank 0 sent no known operation"),
        ({"op": None}, "no known operation"),
        ({"op": "tasks", "tasks": "fit"}, "something other than a list of tasks"),
        ({"op": "tasks", "tasks": [Reply("c0")]}, "something other than a list of tasks"),
    ],
)
def test_a_request_that_rank_0_never_sends_is_refused(message, match):
    with pytest.raises(MessageError, match=match):
        distributed._request_op(message)


def test_the_requests_rank_0_sends_are_accepted():
    for op in ("prepare", "start", "state", "load", "stop"):
        assert distributed._request_op({"op": op}) == op
    assert distributed._request_op({"op": "tasks", "tasks": [Task("fit", 0, "c0")]}) == "tasks"


def transport_answering(monkeypatch: pytest.MonkeyPatch, answer: Any) -> DistributedTransport:
    transport = DistributedTransport(runtime=None, owner={"c0": 0, "c1": 1}, world_size=2)  # type: ignore[arg-type]
    monkeypatch.setattr(distributed, "_recv", lambda src: (answer, 100))
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

    monkeypatch.setattr(distributed, "_recv", receiving)
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
