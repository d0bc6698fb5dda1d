"""SweepPruning: a trial's run reports its validation rounds to the sweep's study, and stops when the pruner says so.

The sweep adds this callback to every trial (``--trainer.callbacks+=...``). On each evaluated round it reads the
round's ``select/value`` (the monitored validation metric, :mod:`fl_lightning.server.round_choice`) and nothing else
of the round's metrics, so pruning never sees a test metric. It records the value as the trial's intermediate value
of that round and asks the study's pruner; when the pruner says prune, the next round's ``on_round_start`` raises
:class:`~fl_lightning.errors.StopFederation`, so the run ends as any stopped run does (the chosen round's models are
tested, ``summary.json`` says ``stopped``), and its ``summary.json`` holds ``sweep.pruned: true``.

Exact resume: the decision is kept in the callback's state (checkpointed each round) and, per round, in the trial
(``fl_lightning:prune`` user attribute): a round that a resumed run trains again asks the database, not the pruner,
whose answer may have changed since as other trials finished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from fl_lightning.callback import FederatedCallback
from fl_lightning.errors import StopFederation

if TYPE_CHECKING:
    import optuna

    from fl_lightning.callback import ServerView

MONITOR_KEY = "select/value"  # the one entry of a round's metrics this callback reads
DECISIONS = "fl_lightning:prune"  # trial user attribute: {round: pruned?} as first decided


class TrialLink:
    """The trial's side of the study: its intermediate values and its pruning decisions.

    Args:
        storage: The study's SQLAlchemy URL.
        study: The study's name.
        trial: The trial's number.
        pruner: ``median`` or ``none`` (:func:`fl_lightning.tools.sweep.study.make_pruner`).
    """

    def __init__(self, storage: str, study: str, trial: int, pruner: str) -> None:
        import optuna

        from fl_lightning.tools.sweep.study import make_pruner, open_storage

        self.storage = open_storage(storage)
        self.study: optuna.Study = optuna.load_study(
            study_name=study, storage=self.storage, sampler=optuna.samplers.RandomSampler(), pruner=make_pruner(pruner)
        )
        study_id = self.storage.get_study_id_from_name(study)
        self.trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, trial)

    def decide(self, step: int, value: float) -> bool:
        """Record ``value`` at ``step`` (once) and whether the trial is pruned after it (decided once per step)."""
        trial = self.storage.get_trial(self.trial_id)
        decisions = dict(trial.user_attrs.get(DECISIONS, {}))
        if str(step) in decisions:  # a round trained again after a resume: the first decision stands
            return bool(decisions[str(step)])
        if step not in trial.intermediate_values:
            self.storage.set_trial_intermediate_value(self.trial_id, step, value)
            trial = self.storage.get_trial(self.trial_id)
        pruned = bool(self.study.pruner.prune(self.study, trial))
        decisions[str(step)] = pruned
        self.storage.set_trial_user_attr(self.trial_id, DECISIONS, decisions)
        return pruned


class SweepPruning(FederatedCallback):
    """Reports each evaluated round's monitored validation value to a sweep trial; ends the run when it is pruned.

    Added by ``python -m fl_lightning.sweep`` to every trial; not meant for a config of one's own.

    Args:
        storage: The study's SQLAlchemy URL.
        study: The study's name.
        trial: The trial's number in the study.
        pruner: The study's pruner, ``median`` or ``none``.
    """

    def __init__(self, *, storage: str, study: str, trial: int, pruner: str = "median") -> None:
        if pruner not in ("median", "none"):
            raise ValueError(f"SweepPruning: pruner must be median or none, got {pruner!r}")
        if trial < 0:
            raise ValueError(f"SweepPruning: trial is a trial number >= 0, got {trial}")
        self.storage, self.study, self.trial, self.pruner = storage, study, trial, pruner
        self.pruned_after: int | None = None  # the round (1-based) after which the pruner said prune
        self.stopped = False
        self.link: TrialLink | None = None

    def connect(self) -> TrialLink:
        """The trial's link to the study (opened on first use: the runtime's copy of the callback never opens one)."""
        if self.link is None:
            self.link = TrialLink(self.storage, self.study, self.trial, self.pruner)
        return self.link

    @override
    def on_round_start(self, server: ServerView, round_idx: int, selected: list[str]) -> None:
        if self.pruned_after is not None:
            self.stopped = True
            raise StopFederation(
                f"pruned by the sweep ({self.pruner} pruner of study {self.study!r}, trial {self.trial}): its "
                f"validation value after round {self.pruned_after} is not promising"
            )

    @override
    def on_round_end(self, server: ServerView, round_idx: int, metrics: dict[str, Any]) -> None:
        value = metrics.get(MONITOR_KEY)
        if value is None or self.pruned_after is not None:  # not an evaluated round
            return
        if self.connect().decide(round_idx + 1, float(value)):
            self.pruned_after = round_idx + 1

    @override
    def summary_entries(self, server: ServerView) -> dict[str, Any]:
        return {
            "sweep": {
                "study": self.study,
                "trial": self.trial,
                "pruned": self.stopped,
                "pruned_after_round": self.pruned_after if self.stopped else None,
            }
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"pruned_after": self.pruned_after}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned_after = state_dict.get("pruned_after")
