"""What crosses the network in a Flower deployment is checked before it is trusted, in both directions.

Records, routing facts, node descriptions, replies, tasks and the state files a site reads back; no Flower
process is started (the parsers are called directly, a site without its build where none is needed).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")

import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict  # noqa: E402

from fl_lightning.engines import flower  # noqa: E402
from fl_lightning.engines.flower import FlowerTransport  # noqa: E402
from fl_lightning.engines.flower_site import Site, SiteSettings, read_state  # noqa: E402
from fl_lightning.engines.flower_wire import MSG, STYPE, pack, parse_description, unpack  # noqa: E402
from fl_lightning.runtime import ClientRuntime  # noqa: E402
from fl_lightning.wire import protocol  # noqa: E402
from fl_lightning.wire.protocol import MessageError, Reply, Task  # noqa: E402

DESCRIPTION = {"clients": {"site0": [40, 10]}, "batch_size": 8, "num_classes": 10, "in_channels": 1,
               "image_size": [8, 8], "seed": 0}  # fmt: skip
DESCRIPTION_SHARED = {k: v for k, v in DESCRIPTION.items() if k != "clients"}


def records(array: Any = None, **meta: Any) -> RecordDict:
    array = Array(dtype="uint8", shape=(3,), stype=STYPE, data=b"abc") if array is None else array
    return RecordDict({MSG: ArrayRecord({"message": array}), flower.META: ConfigRecord(meta)})


# ---------------------------------------------------------------------------------------------------- records
def test_records_from_pack_come_back_whole():
    assert unpack(pack(b"abc", op="task", run="r", round=0, keep_from=0)) == (
        b"abc",
        {"op": "task", "run": "r", "round": 0, "keep_from": 0},
    )
    assert unpack(pack(b"", **{flower.PRECONDITION: "needs SGD"})) == (b"", {flower.PRECONDITION: "needs SGD"})


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (RecordDict({}), "not an fl_lightning Flower message"),
        (records(Array(dtype="float32", shape=(3,), stype=STYPE, data=b"abc")), "unexpected array float32"),
        (records(Array(dtype="uint8", shape=(3,), stype="numpy.ndarray", data=b"abc")), "unexpected array uint8"),
        (records(Array(dtype="uint8", shape=(1000,), stype=STYPE, data=b"abc")), r"shape \(1000,\) does not match"),
        (records(Array(dtype="uint8", shape=(1, 3), stype=STYPE, data=b"abc")), "does not match its 3 bytes"),
        (records(evil="x"), "unknown routing fact 'evil'"),
        (records(round="3"), "routing fact 'round' must be int, not str"),
        (records(round=True), "routing fact 'round' must be int, not bool"),
        (records(round=-1), "negative round -1"),
        (records(keep_from=1.5), "'keep_from' must be int, not float"),
        (records(run=3), "'run' must be str, not int"),
        (records(op="exec"), "unknown operation 'exec'"),
    ],
)
def test_records_that_pack_never_writes_are_refused(content, match):
    with pytest.raises(MessageError, match=match):
        unpack(content)


# ---------------------------------------------------------------------------------------------------- describe
def test_a_sites_description_is_parsed_and_checked():
    assert parse_description(json.dumps(DESCRIPTION).encode(), 7) == DESCRIPTION
    with_partitions = {**DESCRIPTION, "partitions": 3}
    assert parse_description(json.dumps(with_partitions).encode(), 7) == with_partitions


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xff", "UnicodeDecodeError|invalid start byte"),
        (b"{", "Expecting property name"),
        (b"[" * 100_000, "recursion"),
        (b"[1]", r"expected an object of \['batch_size'"),
        (json.dumps({**DESCRIPTION, "evil": 1}).encode(), "expected an object of"),
        (json.dumps({k: v for k, v in DESCRIPTION.items() if k != "seed"}).encode(), "expected an object of"),
        (json.dumps({**DESCRIPTION, "clients": ["site0"]}).encode(), "'clients' maps client ids to"),
        (json.dumps({**DESCRIPTION, "clients": {"site0": [40]}}).encode(), "'clients' maps client ids to"),
        (json.dumps({**DESCRIPTION, "clients": {"site0": [-1, 10]}}).encode(), "'clients' maps client ids to"),
        (json.dumps({**DESCRIPTION, "clients": {"": [1, 1]}}).encode(), "'clients' maps client ids to"),
        (json.dumps({**DESCRIPTION, "batch_size": 0}).encode(), "'batch_size' is a positive integer, not 0"),
        (json.dumps({**DESCRIPTION, "num_classes": True}).encode(), "'num_classes' is a positive integer, not True"),
        (json.dumps({**DESCRIPTION, "partitions": "3"}).encode(), "'partitions' is a positive integer"),
        (json.dumps({**DESCRIPTION, "image_size": [8, -8]}).encode(), "'image_size' is a list of positive integers"),
        (json.dumps({**DESCRIPTION, "image_size": 8}).encode(), "'image_size' is a list of positive integers"),
        (json.dumps({**DESCRIPTION, "seed": 0.5}).encode(), "'seed' is an integer, not 0.5"),
        (b" " * (protocol.MAX_HEADER_BYTES + 1), "more than a description needs"),
    ],
)
def test_a_wrong_description_is_refused_naming_the_node(data, match):
    with pytest.raises(MessageError, match=f"SuperNode 7 described itself wrongly: .*({match})"):
        parse_description(data, 7)


def test_discovery_refuses_a_wrong_description_naming_the_node(monkeypatch):
    transport = FlowerTransport(grid=None)  # type: ignore[arg-type]  # no messages leave: _exchange is replaced
    monkeypatch.setattr(transport, "node_ids", lambda: [7])
    monkeypatch.setattr(transport, "_exchange", lambda items: [(b'{"clients": 1}', {}, None)])
    with (
        pytest.warns(UserWarning, match="SuperNode 7 could not describe itself"),
        pytest.raises(RuntimeError, match="no SuperNode described any client.*SuperNode 7 described itself wrongly"),
    ):
        transport.discover()


def description(*clients: str) -> bytes:
    return json.dumps({"clients": {c: [10, 5] for c in clients}, **DESCRIPTION_SHARED}).encode()


def test_two_nodes_claiming_one_client_are_refused_naming_both(monkeypatch):
    transport = FlowerTransport(grid=None)  # type: ignore[arg-type]
    nodes = [7, 8, 9]
    monkeypatch.setattr(transport, "node_ids", lambda: nodes)
    answers = {7: description("site0", "site1"), 8: description("site1"), 9: description("site2")}
    monkeypatch.setattr(transport, "_exchange", lambda items: [(answers[n], {}, None) for n, _c, _t in items])
    with pytest.warns(UserWarning, match="client 'site1' is claimed by SuperNode 7 and SuperNode 8") as caught:
        desc = transport.discover()
    assert sorted(str(w.message).split(" is refused")[0] for w in caught) == ["SuperNode 7", "SuperNode 8"]
    assert list(desc["clients"]) == ["site2"] and transport.routes == {"site2": 9}
    # a newcomer claiming a connected node's client is refused; the first keeps it; neither is asked again
    nodes.append(10)
    answers[10] = description("site2")
    with pytest.warns(UserWarning, match="client 'site2' is claimed by SuperNode 9 and SuperNode 10"):
        assert list(transport.discover()["clients"]) == ["site2"]
    assert transport.routes == {"site2": 9} and set(transport.refused) == {7, 8, 10}
    monkeypatch.setattr(transport, "_exchange", lambda items: pytest.fail(f"asked again: {items}"))
    transport.discover()
    # a restarted site: its old node failed a task (and lost its description), its new one takes its clients over
    del transport.descriptions[9]
    nodes.append(11)  # the dead node 9 may still be listed for a while; it does not answer
    replies = {9: (b"", {}, "no reply within 60 s"), 11: (description("site2"), {}, None)}
    monkeypatch.setattr(transport, "_exchange", lambda items: [replies[n] for n, _c, _t in items])
    with pytest.warns(UserWarning, match="SuperNode 9 could not describe itself: no reply"):
        assert list(transport.discover()["clients"]) == ["site2"]
    assert transport.routes == {"site2": 11}


# ---------------------------------------------------------------------------------------------------- replies
def transport_replying(monkeypatch: pytest.MonkeyPatch, answer: bytes) -> FlowerTransport:
    transport = FlowerTransport(grid=None)  # type: ignore[arg-type]
    transport.routes, transport.descriptions = {"site0": 7}, {7: {}}
    monkeypatch.setattr(transport, "node_ids", lambda: [7])
    monkeypatch.setattr(transport, "_exchange", lambda items: [(answer, {}, None)] * len(items))
    return transport


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"not a message", r"reply of client 'site0' \(SuperNode 7\): not an fl_lightning message"),
        (protocol.encode({"client_id": "site0"}), "expected a reply from SuperNode 7, got dict"),
        (protocol.encode(Reply("site1")), "SuperNode 7 answered a task of 'site0' for 'site1'"),
    ],
)
def test_a_wrong_reply_fails_its_client_naming_client_and_node(monkeypatch, answer, match):
    transport = transport_replying(monkeypatch, answer)
    for kind in (protocol.FIT, protocol.EVALUATE, protocol.STATS):  # the round goes on without that client
        reply = transport.request(Task(kind, 0, "site0", "global"))
        assert reply.client_id == "site0" and reply.state is None
        assert re.search(rf"its SuperNode 7 failed: its reply is malformed: .*{match}", reply.error), reply.error
        transport.descriptions = {7: {}}  # the failure dropped its description (it is asked again next time)
    with pytest.raises(RuntimeError, match=match):  # a method's query has no failed-client path: the run stops
        transport.request(Task(protocol.QUERY, 0, "site0", "global", query="features"))


def test_records_of_a_wrong_reply_name_the_node(monkeypatch):
    reply = Message(records(round="x"), metadata=Metadata(1, "r1", 7, 0, "m1", "", time.time(), 60.0, "train"))

    class Grid:
        def push_messages(self, messages):
            return ["m1"]

        def pull_messages(self, ids):
            return [reply]

    monkeypatch.setattr(flower, "Message", lambda **kw: None)  # outgoing messages need a Flower run: none leaves
    ((data, meta, error),) = FlowerTransport(Grid())._exchange([(7, pack(b""), "train")])  # type: ignore[arg-type]
    assert data == b"" and meta == {} and error == "its answer is malformed: routing fact 'round' must be int, not str"


def test_a_supernode_refusing_the_app_is_named_and_no_client_is_described(monkeypatch):
    """What a SuperNode with --trusted-entities answers to an unsigned or tampered FAB (Flower's INVALID_FAB): the
    run ends naming the node (the deployment test in test_flower_signed.py runs the real refusal)."""
    from flwr.app import Error
    from flwr.common.constant import ErrorCode

    refusal = Message(
        error=Error(ErrorCode.INVALID_FAB, "The FAB could not be verified."),
        metadata=Metadata(1, "r1", 7, 0, "m1", "", time.time(), 60.0, "query.describe"),
    )
    transport = FlowerTransport(grid=None)  # type: ignore[arg-type]
    monkeypatch.setattr(transport, "node_ids", lambda: [7])
    monkeypatch.setattr(transport, "_send", lambda items: [refusal] * len(items))
    with (
        pytest.warns(UserWarning, match="SuperNode 7 could not describe itself: it refused to run this app"),
        pytest.raises(
            RuntimeError,
            match=r"no SuperNode described any client; errors: \{7: .it refused to run this "
            r"app: no key of its --trusted-entities signed this FAB",
        ),  # fmt: skip
    ):
        transport.discover()


# ---------------------------------------------------------------------------------------------------- site side
def bare_site(tmp_path: Path) -> Site:
    """A site hosting ``site0`` without its build: what arrives is refused before the runtime is used."""
    site = object.__new__(Site)
    site.clients, site.settings, site.run_key = ["site0"], SiteSettings(("site0",), (), tmp_path), None
    return site


@pytest.mark.parametrize(
    ("data", "keep_from", "match"),
    [
        (b"FLM1", None, "not an fl_lightning message"),
        (protocol.encode(Reply("site0")), None, "expected a task, got Reply"),
        (protocol.encode(Task("fit", -1, "site0")), None, r"task of round -1 \(rounds count from 0\)"),
        (protocol.encode(Task("fit", 0, "site0")), "0", "keep_from is a round, not '0'"),
        (protocol.encode(Task("fit", 0, "site9")), None, "client 'site9' is not hosted here"),
    ],
)
def test_a_site_refuses_tasks_it_must_not_run(tmp_path, data, keep_from, match):
    with pytest.raises(MessageError, match=match):
        bare_site(tmp_path).handle(data, keep_from)


@pytest.mark.parametrize("meta", [{"op": "task"}, {"op": flower.RESTORE, "round": 0}, {"run": "r"}])
def test_a_task_or_restore_without_run_and_round_is_refused(monkeypatch, meta):
    monkeypatch.setattr(flower, "site_for", lambda *args: None)  # no site is built
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    metadata = Metadata(1, "m1", 1, 7, "", "", time.time(), 60.0, "train")
    with pytest.raises(MessageError, match="names its run and round"):
        flower.answer(Message(pack(b"", **meta), metadata=metadata), context)


def test_a_damaged_state_file_is_named(tmp_path):
    path = tmp_path / "round-00003.flm"
    path.write_bytes(protocol.encode({"private": {"w": torch.ones(2)}}) + b"\x00")
    with pytest.raises(MessageError, match=f"state file {path} is damaged: message length"):
        read_state(path)
    path.write_bytes(protocol.encode([torch.ones(2)]))
    with pytest.raises(MessageError, match="holds a list, not a runtime state"):
        read_state(path)
    path.write_bytes(protocol.encode({"private": {"site0": {"g": {"w": torch.ones(2)}}}}))
    assert torch.equal(read_state(path)["private"]["site0"]["g"]["w"], torch.ones(2))


@pytest.mark.parametrize(
    ("node_config", "match"),
    [
        ({"partition-id": True, "num-partitions": 2}, "must be integers"),
        ({"partition-id": 0.5, "num-partitions": 2}, "must be integers"),
        ({"fl-args": '--data.path="/srv/a.npz'}, r"node config fl-args=.* is no command line: No closing quotation"),
    ],
)
def test_bad_node_configs_are_named(node_config, match):
    with pytest.raises(ValueError, match=match):
        SiteSettings.from_node_config(node_config)


def test_the_client_runtime_refuses_what_is_not_a_task():
    runtime: Any = object()  # handle_bytes refuses before it uses the runtime
    with pytest.raises(MessageError, match="expected a task, got Reply"):
        ClientRuntime.handle_bytes(runtime, protocol.encode(Reply("c0")))
    hostile = protocol.encode(Task("fit", 0, "c0")).replace(b'"kind":"fit"', b'"kind":"pwn"')
    with pytest.raises(MessageError, match="unknown task kind 'pwn'"):
        ClientRuntime.handle_bytes(runtime, hostile)
