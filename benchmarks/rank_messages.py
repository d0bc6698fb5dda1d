"""A round's messages between two ranks: the distributed engine's wire against one encoded byte buffer per message.

Two processes (gloo on 127.0.0.1, one intra-op thread each) exchange what W1 on two ranks exchanges per round: rank 0
sends rank 1 its clients' fit tasks (each holding the global state of W1's CNN, 545k parameters), rank 1 answers
with as many replies (each its own state). Timed per round trip, alternating, in the same run:

- ``bytes``: each message encoded whole (:func:`~fl_lightning.wire.protocol.encode`), copied into one uint8 tensor
  and sent as that, every task with its own copy of the state (how the engine sent messages before
  :mod:`fl_lightning.engines.rank_wire`);
- ``rank_wire``: the engine's wire, the tensors sent from their own memory and the shared state sent once.

Both sides decode what they receive (the same checks). Prints the median round trip of each and their ratio.

    python benchmarks/rank_messages.py [--clients 5] [--trips 40]
"""

# ruff: noqa: E402 (the imports of the repository follow the sys.path set-up)
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout, installed or not

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fl_lightning.engines import rank_wire
from fl_lightning.engines.local_ranks import free_port
from fl_lightning.models.cnn import SmallCNN
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import Reply, Task


def send_bytes(obj: Any, dst: int) -> dist.Work:
    """The previous wire: the whole encoding in one uint8 tensor, its size first."""
    data = torch.frombuffer(bytearray(protocol.encode(obj)), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst)
    return dist.isend(data, dst)


def recv_bytes(src: int) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src)
    return protocol.decode(memoryview(data.numpy()))


def trip(wire: str, rank: int, tasks: list[Task]) -> None:
    """One round trip: the tasks to rank 1, its replies back."""
    if rank == 0:
        if wire == "bytes":
            send_bytes({"op": "tasks", "tasks": tasks}, 1).wait()
            recv_bytes(1)
        else:
            rank_wire.send(rank_wire.pack_tasks(tasks), 1).wait()
            rank_wire.recv(1)
        return
    if wire == "bytes":
        received = recv_bytes(0)["tasks"]
    else:
        received = rank_wire.unpack_tasks(rank_wire.recv(0)[0])
    replies = [Reply(t.client_id, t.group, state={k: v.clone() for k, v in t.state.items()}) for t in received]
    answer = {"replies": replies, "seconds": 0.0}
    if wire == "bytes":
        send_bytes(answer, 0).wait()
    else:
        rank_wire.send(answer, 0).wait()


def run(rank: int, port: int, clients: int, trips: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = SmallCNN(3, 10, (32, 32), width=32, norm="none")  # W1's network
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tasks = [Task(protocol.FIT, 1, f"site{i}", "global", state=state) for i in range(clients)]
    times: dict[str, list[float]] = {"bytes": [], "rank_wire": []}
    for i in range(2 * trips + 4):  # alternating; the first two of each are warm-up
        wire = ("bytes", "rank_wire")[i % 2]
        dist.barrier()
        start = time.perf_counter()
        trip(wire, rank, tasks)
        if i >= 4:
            times[wire].append(time.perf_counter() - start)
    if rank == 0:
        size = sum(v.numel() * v.element_size() for v in state.values())
        print(f"{clients} tasks and replies of a {size / 2**20:.2f} MiB state, {trips} round trips each")
        medians = {w: statistics.median(t) for w, t in times.items()}
        for wire, median in medians.items():
            print(f"  {wire:9s}  median round trip {1e3 * median:6.2f} ms")
        print(f"  rank_wire / bytes: {medians['rank_wire'] / medians['bytes']:.3f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=5, help="tasks per message (W1 on two ranks: 5)")
    parser.add_argument("--trips", type=int, default=40, help="timed round trips of each wire")
    args = parser.parse_args()
    mp.start_processes(run, args=(free_port(), args.clients, args.trips), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
