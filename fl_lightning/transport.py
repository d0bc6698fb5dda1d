"""Transports carry tasks from the server to a client runtime and replies back, counting the bytes.

``inprocess`` calls the runtime directly (no copies on the hot path; the byte counts are what the encoding
*would* take, computed without encoding). ``serialized`` encodes every task and reply to bytes and decodes
them, and its runtime holds its own module, data and callbacks: a run that works with it sends nothing
across the boundary but messages.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from fl_lightning import protocol
from fl_lightning.protocol import Reply, Task

if TYPE_CHECKING:
    import lightning as L

    from datamodules.base import FederatedDataModule
    from fl_lightning.config import FederationConfig
    from fl_lightning.runtime import ClientRuntime  # Lightning: a remote engine's server needs none of it to start


class Transport:
    """Delivers tasks to the runtime hosting a client; counts the encoded bytes each way.

    The counts (``comm/bytes_*`` of a round) are the sum of ``protocol.encoded_size`` of each :class:`Task` sent
    and each :class:`Reply` received, the message content every engine sends alike. An engine's own wrapping is
    not counted: the envelopes that batch tasks per rank, the ranks' measured times, control messages (prepare,
    start, checkpoint state, stop) or a deployment's routing fields. So the same run reports the same traffic in
    one process, on any number of ranks and on either transport; a deployment counts the same bytes as they
    arrive, except that a reply that never came is not counted.

    Attributes:
        bytes_down: Encoded bytes of the tasks sent since the last :meth:`take_counts`.
        bytes_up: Encoded bytes of the replies received since then.

    """

    name = "base"
    # A simulation's transport may carry what only a simulation should move (e.g. test predictions for pooled
    # metrics); a deployment's (Flower) sets this False.
    simulation = True

    def __init__(self, runtime: ClientRuntime) -> None:
        self.runtime = runtime
        self.bytes_down = 0
        self.bytes_up = 0

    def request(self, task: Task) -> Reply:
        """Send one task and return its reply."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Let the runtime add the callbacks' layers and find its private keys (before any state is loaded)."""
        self.runtime.prepare()

    def start(self, workdir: Any) -> None:
        """Start the runtime (its callbacks' ``on_runtime_start``) with its directory for large files."""
        self.runtime.start(workdir)

    def stream(self, tasks: list[Task]) -> Iterator[Reply]:
        """Send tasks and yield their replies in the order of ``tasks``.

        Here one at a time (each task is sent when the previous reply has been taken, so a caller that
        aggregates as it goes holds one reply at a time); a parallel transport sends them all first.
        """
        for task in tasks:
            yield self.request(task)

    def take_round_metrics(self) -> dict[str, float]:
        """Transport-specific metrics of the round (e.g. per-rank throughput), reset on reading."""
        return {}

    def runtime_state(self) -> dict[str, Any]:
        """The runtime's checkpoint state (every hosted client's)."""
        return self.runtime.state_dict()

    def load_runtime_state(self, state: dict[str, Any]) -> None:
        """Restore the runtime's checkpoint state."""
        self.runtime.load_state_dict(state)

    def take_counts(self) -> tuple[int, int]:
        """``(bytes_down, bytes_up)`` since the last call, and reset them."""
        counts = (self.bytes_down, self.bytes_up)
        self.bytes_down = self.bytes_up = 0
        return counts


class InProcessTransport(Transport):
    """Direct calls: the task's tensors are the server's own (the runtime copies what it loads)."""

    name = "inprocess"

    def request(self, task: Task) -> Reply:  # noqa: D102
        self.bytes_down += protocol.encoded_size(task)
        reply = self.runtime.handle(task)
        self.bytes_up += protocol.encoded_size(reply)
        return reply


class SerializedTransport(Transport):
    """Every task and reply is encoded to bytes and decoded on the other side (and so is checkpoint state)."""

    name = "serialized"

    def request(self, task: Task) -> Reply:  # noqa: D102
        data = protocol.encode(task)
        self.bytes_down += len(data)
        answer = self.runtime.handle_bytes(data)
        self.bytes_up += len(answer)
        return protocol.decode(answer)

    def runtime_state(self) -> dict[str, Any]:  # noqa: D102
        return protocol.decode(protocol.encode(self.runtime.state_dict()))

    def load_runtime_state(self, state: dict[str, Any]) -> None:  # noqa: D102
        self.runtime.load_state_dict(protocol.decode(protocol.encode(state)))


TRANSPORTS: dict[str, type[Transport]] = {"inprocess": InProcessTransport, "serialized": SerializedTransport}


def make_transport(
    config: FederationConfig,
    module: L.LightningModule,
    data: FederatedDataModule,
    trainer: L.Trainer,
    seed: int,
    note: Callable[[str], None] | None = None,
    runtime_factory: Callable[[], ClientRuntime] | None = None,
) -> Transport:
    """The transport ``config.transport`` names, with its client runtime.

    ``inprocess``: one module, data and Trainer for both sides (the server prepares the module, the runtime
    reuses it). ``serialized``: the runtime ``runtime_factory`` builds (the CLI instantiates the config again), or
    deep copies taken now, before the server touches anything.

    Raises:
        ValueError: For an unknown transport, naming the key.
    """
    from fl_lightning.runtime import ClientRuntime

    kind = config.transport
    if kind not in TRANSPORTS:
        raise ValueError(f"federation.transport must be one of {sorted(TRANSPORTS)}, got {kind!r}")
    if kind == "inprocess":
        runtime = ClientRuntime(module, data, trainer, config, seed, prepared=True, note=note)
    elif runtime_factory is not None:
        runtime = runtime_factory()
    else:
        runtime = ClientRuntime(
            copy.deepcopy(module), copy.deepcopy(data), copy.deepcopy(trainer), config, seed, note=note
        )
    return TRANSPORTS[kind](runtime)
