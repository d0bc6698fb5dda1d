"""SweepPruning: reports select/value (and nothing else of the round) to the trial, stops the run when pruned."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from fl_lightning.errors import StopFederation
from fl_lightning.tools.sweep.pruning import DECISIONS, SweepPruning
from fl_lightning.tools.sweep.study import open_storage


class OnlyMonitor(dict):
    """A round's metrics whose entries other than select/value (test metrics among them) raise when read."""

    def _check(self, key):
        if key != "select/value":
            raise AssertionError(f"the pruning callback read {key!r}")

    def __getitem__(self, key):
        self._check(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._check(key)
        return super().get(key, default)

    def items(self):
        raise AssertionError("the pruning callback iterated the round's metrics")

    __iter__ = values = keys = items


def round_metrics(value=None):
    row = OnlyMonitor({"eval/global/acc_mean": 0.99, "val/global/acc_mean": 0.5})
    if value is not None:
        dict.__setitem__(row, "select/value", value)
    return row


@pytest.fixture
def study(tmp_path):
    """A study with five complete trials that reached 0.9 at rounds 1 and 2 (the median pruner's startup)."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=open_storage(url), study_name="s", direction="maximize")
    for _ in range(5):
        study.add_trial(create_trial(value=0.9, params={"lr": 0.1}, distributions={"lr": FloatDistribution(0.01, 1)},
                                     intermediate_values={1: 0.9, 2: 0.9}))  # fmt: skip
    return url, study


def new_trial(study) -> int:
    return study.ask({"lr": FloatDistribution(0.01, 1)}).number


def test_a_bad_round_prunes_and_the_next_round_start_stops_the_run(study):
    url, st = study
    number = new_trial(st)
    cb = SweepPruning(storage=url, study="s", trial=number)
    cb.on_round_end(None, 0, round_metrics())  # not an evaluated round: nothing reported
    assert st.trials[number].intermediate_values == {}
    cb.on_round_end(None, 0, round_metrics(0.1))
    assert cb.pruned_after == 1 and st.trials[number].intermediate_values == {1: 0.1}
    with pytest.raises(StopFederation, match="pruned by the sweep .* after round 1"):
        cb.on_round_start(None, 1, [])
    assert cb.summary_entries(None)["sweep"] == {"study": "s", "trial": number, "pruned": True,
                                                  "pruned_after_round": 1}  # fmt: skip


def test_a_good_round_goes_on(study):
    url, st = study
    number = new_trial(st)
    cb = SweepPruning(storage=url, study="s", trial=number)
    cb.on_round_end(None, 0, round_metrics(0.95))
    cb.on_round_start(None, 1, [])
    assert cb.pruned_after is None and st.trials[number].user_attrs[DECISIONS] == {"1": False}
    assert cb.summary_entries(None)["sweep"]["pruned"] is False


def test_the_decision_survives_a_resume_through_the_checkpoint_and_the_database(study):
    url, st = study
    number = new_trial(st)
    first = SweepPruning(storage=url, study="s", trial=number)
    first.on_round_end(None, 0, round_metrics(0.1))
    restored = SweepPruning(storage=url, study="s", trial=number)
    restored.load_state_dict(first.state_dict())
    with pytest.raises(StopFederation):
        restored.on_round_start(None, 1, [])
    # resumed from an earlier checkpoint: round 1 runs again; the database's first decision stands, whatever the
    # pruner would say now
    again = SweepPruning(storage=url, study="s", trial=number)
    again.on_round_end(None, 0, round_metrics(0.95))
    assert again.pruned_after == 1 and st.trials[number].intermediate_values == {1: 0.1}


def test_without_a_pruner_nothing_is_pruned(study):
    url, st = study
    number = new_trial(st)
    cb = SweepPruning(storage=url, study="s", trial=number, pruner="none")
    cb.on_round_end(None, 0, round_metrics(0.0))
    cb.on_round_start(None, 1, [])
    assert st.trials[number].intermediate_values == {1: 0.0} and st.trials[number].state == TrialState.RUNNING


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="pruner must be median or none"):
        SweepPruning(storage="sqlite://", study="s", trial=0, pruner="hyperband")
    with pytest.raises(ValueError, match="trial number"):
        SweepPruning(storage="sqlite://", study="s", trial=-1)


def test_the_guard_can_fail():
    with pytest.raises(AssertionError, match="eval/global/acc_mean"):
        round_metrics(0.5).get("eval/global/acc_mean")
    with pytest.raises(AssertionError):
        list(round_metrics(0.5).items())
