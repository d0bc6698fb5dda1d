"""One round's record: filled by the round's phases as they run, turned into its ``rounds.csv`` row once."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fl_lightning.outputs import records

if TYPE_CHECKING:
    from fl_lightning.wire.protocol import Reply

PHASES = ("train", "aggregate", "eval")


@dataclass
class RoundRecord:
    """What a round did: who was selected, trained and failed, its phases' times, its traffic, its evaluation.

    Attributes:
        round: The round's 1-based number.
        selected: The selected client ids (the pooled pseudo-client in centralised mode).
        trained: Per successful client, its reply's counts and train metrics (``metrics.csv``'s train columns).
        failed: Ids of the clients whose fit failed, in the order their replies came.
        samples: Training samples in the successful clients' batches (for the throughput).
        seconds: Seconds spent per phase: ``train`` (waiting for fit replies), ``aggregate``, ``eval``.
        comm: ``(bytes_down, bytes_up)`` of the round's fit and peer-to-peer tasks (``train``) and of its
            evaluation (``eval``).
        evaluation: The round's evaluation (``{}`` on a round without one).
        extra: Further ``rounds.csv`` entries of the round (the model selection's ``select/value``, …).
        started: ``time.perf_counter()`` when the round started.

    """

    round: int
    selected: list[str]
    trained: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    samples: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    comm: dict[str, tuple[int, int]] = field(default_factory=dict)
    evaluation: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``phase``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def timed_each(self, phase: str, items: Iterable[Any]) -> Iterator[Any]:
        """Yield ``items``, adding the time each takes to produce (e.g. a fit reply's wait) to ``phase``."""
        it = iter(items)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self.seconds[phase] += time.perf_counter() - t0
            yield item

    def add_reply(self, client_id: str, reply: Reply, batch_size: int, fixed_steps: bool) -> None:
        """Record a successful fit reply: its counts, its train metrics and its batches' samples."""
        self.samples += records.samples_trained(reply, batch_size, fixed_steps)
        self.trained[client_id] = {
            "train_samples": reply.num_samples,
            "train_steps": reply.num_steps,
            **reply.metrics,
        }

    def row(self, transport_metrics: dict[str, float], evaluated: int | None = None) -> dict[str, Any]:
        """The round's ``rounds.csv`` row.

        Args:
            transport_metrics: The transport's own round metrics (e.g. per-rank throughput).
            evaluated: Clients evaluated this round, recorded only when ``federation.eval_clients`` samples them.
        """
        train = self.seconds["train"]
        (bytes_down, bytes_up), (eval_down, eval_up) = self.comm["train"], self.comm["eval"]
        row = {
            "round": self.round,
            "selected": len(self.selected),
            "round/failed_clients": len(self.failed),
            "time/train": train,
            "time/aggregate": self.seconds["aggregate"],
            "time/eval": self.seconds["eval"],
            "time/round": time.perf_counter() - self.started,
            "throughput/samples_per_s": self.samples / train if train else 0.0,
            "comm/bytes_down": bytes_down,
            "comm/bytes_up": bytes_up,
            "comm/eval_bytes_down": eval_down,
            "comm/eval_bytes_up": eval_up,
            **transport_metrics,
        }
        if evaluated is not None:  # only with sampling on: rounds.csv is unchanged without it
            row["round/evaluated_clients"] = evaluated
        row.update(records.evaluation_means(self.evaluation))
        row.update(self.extra)
        return row
