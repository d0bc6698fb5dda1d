"""Simulation across processes and GPUs on torch.distributed: the clients are sharded over ranks.

Rank 0 is the server (the :class:`~fl_lightning.server.federation.Federation`, the run directory, the loggers) and
also hosts a shard of the clients; every other rank runs :func:`serve`, a loop that answers the server's
messages with its own :class:`~fl_lightning.runtime.ClientRuntime`. Messages are our encoded tasks and
replies (:mod:`fl_lightning.wire.protocol`), their tensors sent as they are over the gloo backend
(:mod:`~fl_lightning.engines.rank_wire`; CPU tensors: NCCL cannot send those, so a CUDA run keeps gloo for the
messages), each distinct model state of a batch of tasks once. Per batch of tasks the server sends every rank its
share first, handles its own, then collects the replies and hands them on in task order, so results do not
depend on the number of ranks.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from fl_lightning.engines import rank_wire
from fl_lightning.errors import RankError
from fl_lightning.runtime import ClientRuntime
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import POOLED, Reply, Task
from fl_lightning.wire.transport import Transport

# Environment variables torchrun sets; Lightning would read them as a request for its own multi-process
# training, so each rank hides them from its (single-device) Trainer once the process group is up.
ELASTIC_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "ROLE_NAME")  # fmt: skip
# Per-client entries of a runtime's checkpoint state (everything else is shared by the ranks).
PER_CLIENT = ("private", "optimizer_states", "callback_states", "subset_samplers", "data", "generations", "personal",
              "fit_rounds", "kept_round")  # fmt: skip
_OPS = ("tasks", "prepare", "start", "state", "load", "stop")  # what rank 0 asks the other ranks


def shard_clients(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Each client's rank: balanced by training samples (largest first, to the least-loaded rank).

    Ties (in size, and in load) go to the client id order and to the lowest rank, so the shards depend
    only on the sizes and the number of ranks. The pooled pseudo-client of centralised runs lives on rank 0.

    Args:
        sizes: Training samples per client.
        world_size: Number of ranks.

    Returns:
        ``{client: rank}``.
    """
    load = [0] * world_size
    owner = {}
    for cid in sorted(sizes, key=lambda c: (-sizes[c], c)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[cid] = rank
        load[rank] += sizes[cid]
    owner[POOLED] = 0
    return owner


def split_runtime_state(state: dict[str, Any], owner: dict[str, int], rank: int) -> dict[str, Any]:
    """The part of a (merged) runtime checkpoint state that belongs to ``rank``'s clients."""
    out = {k: v for k, v in state.items() if k not in PER_CLIENT}
    for key in PER_CLIENT:
        out[key] = {c: v for c, v in state.get(key, {}).items() if owner.get(c, 0) == rank}
    return out


def merge_runtime_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One runtime checkpoint state from the ranks' (their clients are disjoint), as one process writes it."""
    merged = {k: v for k, v in states[0].items() if k not in PER_CLIENT}
    for key in PER_CLIENT:
        merged[key] = {}
        for state in states:
            merged[key].update(state.get(key, {}))
    return merged


# ------------------------------------------------------------------------------ requests and answers
def _answer_field(answer: Any, rank: int, key: str, types: type | tuple[type, ...]) -> Any:
    """``answer[key]`` of a rank's answer, checked to be one of ``types``.

    Raises:
        protocol.MessageError: If the answer is no dict or lacks the field, naming the rank.

    """
    value = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(value, types):
        names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise protocol.MessageError(f"rank {rank}'s answer has no {key!r} of type {names}: {_brief(answer)}")
    return value


def _request_op(message: Any) -> str:
    """The operation of a message from rank 0 (a dict with a known ``op``).

    Raises:
        protocol.MessageError: If the message is not one rank 0 sends.

    """
    op = message.get("op") if isinstance(message, dict) else None
    if op not in _OPS:
        raise protocol.MessageError(f"rank 0 sent no known operation ({', '.join(_OPS)}): {_brief(message)}")
    return op


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


class _Answers(threading.Thread):
    """Receives the answers of ``ranks``, in that order, in a thread of its own; :meth:`wait` returns them.

    gloo waits for a message without holding the GIL, so rank 0 handles its own clients meanwhile.
    """

    def __init__(self, collect: Callable[[int], dict[str, Any]], ranks: list[int]) -> None:
        super().__init__(name="rank-answers", daemon=True)  # daemon: a rank 0 that fails does not wait for it
        self._collect, self._ranks = collect, ranks
        self._answers: dict[int, dict[str, Any]] = {}
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        """Collect every rank's answer; keep the first error for :meth:`wait`."""
        try:
            for rank in self._ranks:
                self._answers[rank] = self._collect(rank)
        except BaseException as err:  # noqa: BLE001 - raised again in the thread that waits for the answers
            self._error = err

    def wait(self) -> dict[int, dict[str, Any]]:
        """Every rank's answer, by rank.

        Raises:
            RankError: If a rank failed, died or hung (what collecting its answer raised).
            protocol.MessageError: If a rank's answer is malformed, naming the rank.
        """
        self.join()
        if self._error is not None:
            raise self._error
        return self._answers


class DistributedTransport(Transport):
    """The server's transport over torch.distributed: tasks go to the rank hosting their client.

    Args:
        runtime: Rank 0's own runtime (its shard of the clients; it shares the server's module).
        owner: Each client's rank.
        world_size: Number of ranks.
    """

    name = "distributed"

    def __init__(self, runtime: ClientRuntime, owner: dict[str, int], world_size: int) -> None:
        super().__init__()
        self.runtime, self.owner, self.world_size = runtime, owner, world_size
        self._seconds = [0.0] * world_size
        self._samples = [0] * world_size

    # ------------------------------------------------------------------ messages
    def _post(self, rank: int, message: Any) -> rank_wire.Sending:
        # Not counted here: comm/bytes_* are the tasks' and replies' own sizes (see stream), not this envelope's.
        try:
            work = rank_wire.send(message, rank)
        except RuntimeError as err:
            raise RankError(f"rank {rank} is unreachable (it died?): {err}") from err
        return work

    def _collect(self, rank: int) -> dict[str, Any]:
        try:
            answer, _ = rank_wire.recv(rank)
        except RuntimeError as err:
            raise RankError(f"rank {rank} did not answer (it died, or hung past the timeout): {err}") from err
        if not isinstance(answer, dict):
            raise protocol.MessageError(f"rank {rank} answered with a {type(answer).__name__}, not a dict")
        if answer.get("error"):
            raise RankError(f"rank {rank} failed:\n{_answer_field(answer, rank, 'error', str)}")
        return answer

    def _exchange(self, per_rank: dict[int, Any]) -> dict[int, Any]:
        """Send each remote rank its message, then collect every answer (naming a rank that fails)."""
        pending = [self._post(rank, message) for rank, message in per_rank.items()]
        answers = {rank: self._collect(rank) for rank in per_rank}
        for work in pending:
            work.wait()
        return answers

    def _broadcast(self, op: str, **fields: Any) -> dict[int, Any]:
        return self._exchange({r: {"op": op, **fields} for r in range(1, self.world_size)})

    @override
    def request(self, task: Task) -> Reply:
        return next(self.stream([task]))

    @override
    def stream(self, tasks: list[Task]) -> Iterator[Reply]:
        remote: dict[int, list[int]] = {}
        local: list[int] = []
        for i, task in enumerate(tasks):
            rank = self.owner.get(task.client_id, 0)
            (local if rank == 0 else remote.setdefault(rank, [])).append(i)
        replies: list[Reply | None] = [None] * len(tasks)
        # Counted per task and reply as one process counts them, whatever rank handles them (the envelopes, the
        # ranks' timings and the control messages are this engine's own, not traffic of the run).
        self.bytes_down += sum(protocol.encoded_size(task) for task in tasks)
        # Remote ranks first (they work while rank 0 handles its own), then rank 0's, then collect.
        pending = [self._post(rank, rank_wire.pack_tasks([tasks[i] for i in idx])) for rank, idx in remote.items()]
        # A rank done before rank 0 sends its replies meanwhile: received (and decoded) while rank 0 still works.
        answers = _Answers(self._collect, list(remote))
        t0 = time.perf_counter()
        if local:
            for i, reply in zip(local, self.runtime.handle_many([tasks[i] for i in local]), strict=True):
                replies[i] = reply
                self._count(0, tasks[i], reply)
        fit = bool(tasks) and tasks[0].kind == protocol.FIT  # a batch holds one kind of task; throughput counts fits
        if fit:
            self._seconds[0] += time.perf_counter() - t0
        received = answers.wait()
        for rank, indices in remote.items():
            answer = received[rank]
            got = _answer_field(answer, rank, "replies", list)
            if len(got) != len(indices) or not all(isinstance(r, Reply) for r in got):
                raise protocol.MessageError(f"rank {rank} answered {len(indices)} tasks with {_brief(got)}")
            for i, reply in zip(indices, got, strict=True):
                replies[i] = reply
                self._count(rank, tasks[i], reply)
            if fit:
                self._seconds[rank] += _answer_field(answer, rank, "seconds", (float, int))
        for work in pending:
            work.wait()
        self.bytes_up += sum(protocol.encoded_size(reply) for reply in replies)
        yield from replies

    def _count(self, rank: int, task: Task, reply: Reply) -> None:
        if task.kind == protocol.FIT and reply.error is None:
            self._samples[rank] += reply.num_samples * (task.epochs if task.steps is None else 1)

    @override
    def take_round_metrics(self) -> dict[str, float]:
        out = {
            f"throughput/rank{r}/samples_per_s": (self._samples[r] / self._seconds[r]) if self._seconds[r] else 0.0
            for r in range(self.world_size)
        }
        self._seconds = [0.0] * self.world_size
        self._samples = [0] * self.world_size
        return out

    # ------------------------------------------------------------------ runtime control
    @override
    def prepare(self) -> None:
        self.runtime.prepare()
        self._broadcast("prepare")

    @override
    def start(self, workdir: Any) -> None:
        self.runtime.start(workdir)
        self._broadcast("start", workdir=str(workdir) if workdir is not None else None)

    @override
    def runtime_state(self) -> dict[str, Any]:
        answers = self._broadcast("state")
        states = [_answer_field(answers[r], r, "state", dict) for r in sorted(answers)]
        return merge_runtime_states([self.runtime.state_dict(), *states])

    @override
    def load_runtime_state(self, state: dict[str, Any]) -> None:
        self.runtime.load_state_dict(split_runtime_state(state, self.owner, 0))
        self._exchange(
            {r: {"op": "load", "state": split_runtime_state(state, self.owner, r)} for r in range(1, self.world_size)}
        )

    def close(self) -> None:
        """Let the other ranks leave their loop."""
        self._broadcast("stop")


def serve(runtime: ClientRuntime) -> None:
    """A non-zero rank: answer rank 0's messages with ``runtime`` until it says stop.

    An exception while answering goes back to rank 0 (which stops the run naming this rank) instead of
    killing this process silently.
    """
    while True:
        try:
            message, _ = rank_wire.recv(0)
            op = _request_op(message)
            tasks = rank_wire.unpack_tasks(message) if op == "tasks" else []
        except protocol.MessageError:  # reported to rank 0; what follows on the wire can no longer be trusted
            rank_wire.send({"error": traceback.format_exc()}, 0).wait()
            return
        try:
            if op == "stop":
                rank_wire.send({"ok": True}, 0).wait()
                return
            if op == "tasks":
                t0 = time.perf_counter()
                replies = list(runtime.handle_many(tasks))
                answer = {"replies": replies, "seconds": time.perf_counter() - t0}
            elif op == "prepare":
                runtime.prepare()
                answer = {"ok": True}
            elif op == "start":
                runtime.start(Path(message["workdir"]) if message["workdir"] else None)
                answer = {"ok": True}
            elif op == "state":
                answer = {"state": runtime.state_dict()}
            elif op == "load":
                runtime.load_state_dict(message["state"])
                answer = {"ok": True}
            else:
                raise ValueError(f"unknown message {op!r}")
        except Exception:  # noqa: BLE001 - reported to rank 0, which stops the run with it
            answer = {"error": traceback.format_exc()}
        rank_wire.send(answer, 0).wait()
        if "error" in answer:
            return


# ---------------------------------------------------------------------------------------------- set-up
def environment_rank() -> tuple[int, int, int] | None:
    """``(rank, world size, local rank)`` when launched by torchrun (or our own launcher), else ``None``."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def hide_elastic_environment() -> None:
    """Remove torchrun's rank variables (MASTER_ADDR/PORT stay for :func:`init_process_group`).

    Lightning reads them as a request for its own multi-process training; each rank's Trainer must stay a
    single-device Trainer, so they go before it is built.
    """
    for var in ELASTIC_VARS:
        os.environ.pop(var, None)


def init_process_group(rank: int, world_size: int, timeout_s: float) -> None:
    """Join the process group: gloo for the messages (and ``cuda:nccl`` next to it when CUDA is there).

    ``timeout_s`` bounds every wait for another rank, so a rank that hangs stops the run instead of hanging it.
    """
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), rank=rank, world_size=world_size)


def destroy_process_group() -> None:
    """Leave the process group (if joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def device_index(local_rank: int, workers_per_device: int) -> int:
    """The GPU of a rank when ``workers_per_device`` ranks share one: ``local_rank // workers_per_device``."""
    return local_rank // max(1, workers_per_device)
