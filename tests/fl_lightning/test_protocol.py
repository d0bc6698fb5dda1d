"""Messages: plain data in, the same plain data out; nothing is ever unpickled."""

import pickle

import pytest
import torch

from fl_lightning.wire.protocol import MessageError, Reply, Task, decode, encode, encode_parts, encoded_size


def test_round_trip_of_every_plain_type_and_dtype():
    tensors = {str(dt): torch.arange(6).reshape(2, 3).to(dt) for dt in (torch.float32, torch.float64, torch.bfloat16,
               torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)}  # fmt: skip
    value = {
        "tensors": tensors,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "numbers": [1, 2.5, float("nan"), float("inf"), -float("inf"), True, None],
        "nested": {"a": ("x", 1), 3: {"k": [torch.ones(2)]}, (1, 2): "tuple key"},
        "text": "héllo",
    }
    out = decode(encode(value))
    for name, t in tensors.items():
        assert out["tensors"][name].dtype == t.dtype and torch.equal(out["tensors"][name], t)
    assert out["scalar"].shape == () and float(out["scalar"]) == 3.5
    assert out["empty"].shape == (0, 4)
    nums = out["numbers"]
    assert nums[0:2] == [1, 2.5] and nums[2] != nums[2] and nums[3:] == [float("inf"), -float("inf"), True, None]
    assert out["nested"]["a"] == ("x", 1) and torch.equal(out["nested"][3]["k"][0], torch.ones(2))
    assert out["nested"][(1, 2)] == "tuple key" and out["text"] == "héllo"
    assert encoded_size(value) == len(encode(value))


def test_counting_a_message_reads_no_tensor_data():
    """The in-process transport counts bytes per message; a GPU tensor must not be copied to the host for that.

    A tensor on the ``meta`` device has a shape and dtype but no data: any copy of it fails.
    """
    shapes = {"w": (3, 4), "b": (4,)}
    real = Reply("c0", "g", state={k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()})
    meta = Reply("c0", "g", state={k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes.items()})
    assert encoded_size(meta) == len(encode(real))


def test_tasks_and_replies_come_back_as_themselves_with_a_task_inside_a_payload():
    inner = Task("fit", 1, "c1", "g", state={"w": torch.ones(2)})
    task = Task("query", 2, "c0", "global", query="X/selector", payloads={"X": {"task": inner}})
    out = decode(encode(task))
    assert isinstance(out, Task) and out.query == "X/selector" and isinstance(out.payloads["X"]["task"], Task)
    assert torch.equal(out.payloads["X"]["task"].state["w"], torch.ones(2))
    reply = decode(encode(Reply("c0", "g", error="boom", metrics={"train_loss": 0.5})))
    assert isinstance(reply, Reply) and reply.error == "boom" and reply.metrics == {"train_loss": 0.5}


def test_the_parts_of_an_encoding_make_it_up_and_view_contiguous_tensors_without_a_copy():
    w, strided = torch.arange(12.0).reshape(3, 4), torch.arange(12.0).reshape(3, 4).t()
    value = {"w": w, "t": strided, "empty": torch.zeros(0), "mask": torch.tensor([True, False]), "n": 3}
    head, buffers = encode_parts(value)
    assert head + b"".join(b.numpy().tobytes() for b in buffers) == encode(value)
    assert [b.dtype for b in buffers] == [torch.uint8] * 3 and [b.numel() for b in buffers] == [48, 48, 2]
    assert buffers[0].data_ptr() == w.data_ptr()  # a view of the contiguous tensor
    assert torch.equal(buffers[1].view(torch.float32), strided.contiguous().reshape(-1))


def test_decoded_tensors_are_independent_copies():
    t = torch.zeros(3)
    out = decode(encode({"t": t}))
    out["t"] += 1
    assert torch.equal(t, torch.zeros(3))


class Evil:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickle ran')",))


def test_nothing_is_unpickled_and_bad_bytes_are_clear_errors():
    with pytest.raises(MessageError, match="magic"):
        decode(pickle.dumps(Evil()))
    good = encode({"w": torch.ones(4)})
    with pytest.raises(MessageError, match="length"):
        decode(good[:-3])
    with pytest.raises(MessageError):
        decode(good[:12] + b"{not json" + good[21:])
    with pytest.raises(TypeError, match="plain data only"):
        encode({"obj": Evil()})
