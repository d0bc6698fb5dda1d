"""The Transport base: what the server calls to reach the clients, whatever carries the messages.

A transport delivers :class:`~fl_lightning.wire.protocol.Task` messages to the runtime that hosts each client and
brings the :class:`~fl_lightning.wire.protocol.Reply` back, counting the encoded bytes both ways. This base holds
no runtime: the engines (:mod:`fl_lightning.engines`) subclass it, in process, over torch.distributed ranks or
through Flower.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fl_lightning.wire.protocol import Reply, Task


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

    def __init__(self) -> None:
        self.bytes_down = 0
        self.bytes_up = 0

    def request(self, task: Task) -> Reply:
        """Send one task and return its reply."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Let the runtimes add the callbacks' layers and find their private keys (before any state is loaded)."""

    def start(self, workdir: Any) -> None:
        """Start the runtimes (their callbacks' ``on_runtime_start``); ``workdir`` is the run's directory."""

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
        """The runtimes' checkpoint state (every hosted client's)."""
        raise NotImplementedError

    def load_runtime_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`runtime_state`."""
        raise NotImplementedError

    def take_counts(self) -> tuple[int, int]:
        """``(bytes_down, bytes_up)`` since the last call, and reset them."""
        counts = (self.bytes_down, self.bytes_up)
        self.bytes_down = self.bytes_up = 0
        return counts
