"""Which trial a worker runs next: an orphaned one to continue, a new one to sample, or none (pure decisions).

The study must end with exactly ``trials`` complete or pruned trials, none run twice. A ``RUNNING`` trial whose
worker is gone (:mod:`.owners`) is continued under its own number and parameters, never sampled again as a new
trial; a new trial is asked for only while the complete, pruned and still-running trials fall short of the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from fl_lightning.tools.sweep.owners import GRACE, Owner, is_alive

DONE = (TrialState.COMPLETE, TrialState.PRUNED)
FAILED_ATTR = "fl_lightning:error"


@dataclass(frozen=True)
class Decision:
    """What a worker does next.

    Attributes:
        action: ``continue`` (an orphan), ``new`` (ask the study for a trial), ``abandon`` (an orphan without
            parameters: its worker died inside Optuna's ``ask``; told FAIL, it never started a run), or ``stop``.
        trial: The trial to continue or abandon.
        reason: Why ``stop`` (for the log).
    """

    action: str
    trial: FrozenTrial | None = None
    reason: str = ""


def counts(trials: Sequence[FrozenTrial]) -> dict[str, int]:
    """``{"done", "running", "failed"}``: complete or pruned, running, and failed trials."""
    return {
        "done": sum(t.state in DONE for t in trials),
        "running": sum(t.state == TrialState.RUNNING for t in trials),
        "failed": sum(t.state == TrialState.FAIL for t in trials),
    }


def orphans(trials: Sequence[FrozenTrial], now: float, here: Owner | None = None) -> list[FrozenTrial]:
    """The ``RUNNING`` trials whose worker is gone, oldest first.

    A trial without an owner record was asked for by a worker that died before writing it; it counts as gone once
    it is older than the grace period (another machine's worker may be between the two writes).
    """
    out = []
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        owner = Owner.of(t.user_attrs)
        if owner is None:
            started = t.datetime_start.timestamp() if t.datetime_start else now
            if now - started >= GRACE:
                out.append(t)
        elif not is_alive(owner, t.user_attrs, now, here):
            out.append(t)
    return sorted(out, key=lambda t: t.number)


def decide(
    trials: Sequence[FrozenTrial], target: int, max_failures: int, now: float, here: Owner | None = None
) -> Decision:
    """The next action of a worker, given the study's trials (read under the claim lock).

    Orphans first (continuing them is how a killed sweep goes on), then new trials while the target is not met
    and fewer than ``max_failures`` trials have failed.
    """
    for t in orphans(trials, now, here):
        return Decision("continue" if t.params else "abandon", t)
    n = counts(trials)
    if n["done"] >= target:
        return Decision("stop", reason=f"the study holds {n['done']} complete or pruned trials (target {target})")
    if n["done"] + n["running"] >= target:
        return Decision("stop", reason=f"the last {n['running']} trials are running in other workers")
    if n["failed"] >= max_failures:
        return Decision("stop", reason=f"{n['failed']} trials failed (their run directories and the logs say why)")
    return Decision("new")


def trial_values(trial: FrozenTrial, fixed: dict[str, Any]) -> dict[str, Any]:
    """The settings of a trial: its sampled parameters and the space's fixed values."""
    return {**fixed, **trial.params}
