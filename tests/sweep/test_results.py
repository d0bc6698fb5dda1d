"""sweep_results.csv (one row per trial), objective.png, and importance.png only when there is something to rank."""

from __future__ import annotations

import csv

import optuna
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from fl_lightning.tools.sweep.owners import PREFIX
from fl_lightning.tools.sweep.results import plot_importance, plot_objective, write_results

DIST = {"lr": FloatDistribution(0.001, 1.0, log=True), "mu": FloatDistribution(0.0, 1.0)}


def study_with(values):
    study = optuna.create_study(direction="maximize")
    for i, (state, value) in enumerate(values):
        study.add_trial(create_trial(
            state=state, value=value if state == TrialState.COMPLETE else None,
            params={"lr": 0.01 * (i + 1), "mu": 0.1 * i}, distributions=DIST,
            intermediate_values={1: value} if value is not None else {},
            user_attrs={f"{PREFIX}round": 2, f"{PREFIX}run_dir": f"trials/trial-{i:04d}", f"{PREFIX}run_seconds": 1.5},
        ))  # fmt: skip
    return study


def test_one_row_per_trial_with_its_state_value_round_run_dir_and_parameters(tmp_path):
    study = study_with([(TrialState.COMPLETE, 0.8), (TrialState.PRUNED, 0.3), (TrialState.FAIL, None)])
    path = write_results(tmp_path / "sweep_results.csv", study.trials, ["lr", "mu"])
    rows = list(csv.DictReader(path.open()))
    assert [r["state"] for r in rows] == ["complete", "pruned", "fail"]
    assert rows[0] == {"number": "0", "state": "complete", "value": "0.8", "chosen_round": "2",
                       "run_dir": "trials/trial-0000", "run_seconds": "1.5", "lr": "0.01", "mu": "0.0"}  # fmt: skip
    assert rows[2]["value"] == ""


def test_the_plots(tmp_path):
    study = study_with([(TrialState.COMPLETE, v) for v in (0.2, 0.5, 0.4, 0.7, 0.6)])
    assert plot_objective(tmp_path / "objective.png", study.trials, "val/acc_mean", "maximize").stat().st_size > 0
    assert plot_importance(tmp_path / "importance.png", study) == f"wrote {tmp_path / 'importance.png'}"
    assert (tmp_path / "importance.png").stat().st_size > 0


def test_no_importance_from_fewer_than_two_complete_trials(tmp_path):
    study = study_with([(TrialState.COMPLETE, 0.5), (TrialState.PRUNED, 0.1)])
    note = plot_importance(tmp_path / "importance.png", study)
    assert "not written: 1 complete trial(s)" in note and not (tmp_path / "importance.png").exists()
