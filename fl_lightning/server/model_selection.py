"""Which round's models are reported: the monitored validation metric, the best round so far, early stopping.

Pure bookkeeping over evaluations (the dicts of :func:`fl_lightning.server.evaluation.evaluate`): nothing here
sends a task or reads a test metric. A monitor names a validation metric only (``val/...``), and
:func:`monitored_value` is only ever given a validation evaluation by the Federation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from fl_lightning.server.evaluation import LOWER_IS_BETTER

STATS = ("mean", "worst", "std")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Monitor:
    """A parsed ``federation.monitor``: the validation metric that chooses the round.

    Attributes:
        text: The monitor as configured (``val/acc_mean``).
        model: ``global``, ``personal``, a callback's model name, or ``pooled``.
        metric: The metric's name (``acc``, ``loss``, ``dice`` …).
        stat: ``mean``, ``worst`` or ``std`` over clients (``mean`` for the pooled model, which has one value).
    """

    text: str
    model: str
    metric: str
    stat: str

    @property
    def lower_is_better(self) -> bool:
        """Whether a smaller value is better (loss, HD95 and any spread across clients)."""
        return self.metric in LOWER_IS_BETTER or self.stat == "std"


def parse_monitor(text: str) -> Monitor:
    """Parse ``val/[<model>/]<metric>[_mean|_worst|_std]`` or ``val/pooled/<metric>``.

    Raises:
        ValueError: Naming ``federation.monitor`` when the text is not a validation metric of that form.
    """
    parts = text.split("/")
    if parts[0] != "val" or len(parts) not in (2, 3) or not all(_NAME.match(p) for p in parts[1:]):
        raise ValueError(
            f"federation.monitor={text!r}: expected val/[<model>/]<metric>[_mean|_worst|_std] (e.g. val/acc_mean, "
            "val/acc_worst, val/personal/dice_mean, val/pooled/acc): the round is chosen on validation metrics only"
        )
    model = parts[1] if len(parts) == 3 else "global"
    name = parts[-1]
    if model == "pooled":
        return Monitor(text, "pooled", name, "mean")
    for stat in STATS:
        if name.endswith(f"_{stat}"):
            return Monitor(text, model, name.removesuffix(f"_{stat}"), stat)
    return Monitor(text, model, name, "mean")


def default_monitor(primary_metric: str, has_global_model: bool) -> str:
    """The monitor when none is configured: the primary metric's client mean on the global (else personal) model."""
    return f"val/{primary_metric}_mean" if has_global_model else f"val/personal/{primary_metric}_mean"


def monitored_value(evaluation: dict[str, Any], monitor: Monitor) -> float | None:
    """The monitor's value in a validation evaluation: NaN where every client's is NaN, None where none has it."""
    if monitor.model == "pooled":
        value = evaluation.get("pooled", {}).get(monitor.metric)
    else:
        value = evaluation.get("summary", {}).get(monitor.model, {}).get(monitor.metric, {}).get(monitor.stat)
        if value is None:  # summarise() leaves out a metric that is NaN on every client
            per_client = evaluation.get("clients", {}).get(monitor.model, {})
            value = math.nan if any(monitor.metric in m for m in per_client.values()) else None
    return None if value is None else float(value)


def available_monitors(evaluation: dict[str, Any]) -> list[str]:
    """Every monitor an evaluation can answer, for the message of a monitor it cannot."""
    out = [f"val/pooled/{m}" for m in evaluation.get("pooled", {})]
    for model, stats in evaluation.get("summary", {}).items():
        prefix = "val/" if model == "global" else f"val/{model}/"
        out += [f"{prefix}{metric}_{stat}" for metric in stats for stat in STATS]
    return sorted(out)


@dataclass
class Selection:
    """The best validation round so far and how many evaluation rounds have passed without improving on it.

    Attributes:
        monitor: What is monitored.
        best_round: The best round (1-based; 0 before the first evaluation).
        best_value: The monitor's value at ``best_round``.
        since_best: Evaluation rounds since ``best_round`` that did not improve on it.
        history: ``(round, value)`` of every evaluation round, in order.
        best_summary: The validation evaluation's ``summary`` at ``best_round`` (for ``summary.json``).
    """

    monitor: Monitor
    best_round: int = 0
    best_value: float | None = None
    since_best: int = 0
    history: list[tuple[int, float]] = field(default_factory=list)
    best_summary: dict[str, Any] = field(default_factory=dict)

    def update(self, round_idx: int, value: float) -> bool:
        """Record round ``round_idx``'s (1-based) value; whether it is the new best (ties keep the earlier round).

        A NaN value (a diverged model) never improves.
        """
        self.history.append((round_idx, value))
        if math.isnan(value):
            improved = False
        elif self.best_value is None:
            improved = True
        else:
            improved = value < self.best_value if self.monitor.lower_is_better else value > self.best_value
        if improved:
            self.best_round, self.best_value, self.since_best = round_idx, value, 0
        else:
            self.since_best += 1
        return improved

    def stop_reason(self, patience: int | None) -> str | None:
        """Why the run stops early now (``patience`` evaluation rounds without improvement), else None."""
        if patience is None or self.best_value is None or self.since_best < patience:
            return None
        return (
            f"early stopping: {self.monitor.text} has not improved for {self.since_best} evaluation rounds "
            f"(federation.patience={patience}); the best was {self.best_value:.6g} at round {self.best_round}"
        )

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (the monitor is the config's)."""
        return {
            "best_round": self.best_round,
            "best_value": self.best_value,
            "since_best": self.since_best,
            "history": [[r, v] for r, v in self.history],
            "best_summary": self.best_summary,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.best_round, self.since_best = int(state["best_round"]), int(state["since_best"])
        self.best_value = None if state["best_value"] is None else float(state["best_value"])
        self.history = [(int(r), float(v)) for r, v in state["history"]]
        self.best_summary = dict(state.get("best_summary") or {})
