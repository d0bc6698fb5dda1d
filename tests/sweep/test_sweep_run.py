"""The sweep in this process: input refused before any trial, an orphan continued from its checkpoint bit for bit,
and a pruned trial's run directory saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optuna.trial import TrialState

from fl_lightning.cli import main as train
from fl_lightning.tools.sweep.claims import trial_values
from fl_lightning.tools.sweep.cli import build_parser, main, plan_from
from fl_lightning.tools.sweep.owners import Owner, this_process
from fl_lightning.tools.sweep.study import Plan, check_plan, load_study
from fl_lightning.tools.sweep.trial_run import run_args, trial_args, trial_dir
from fl_lightning.tools.sweep.worker import distributions, work
from tests.anchors.runs import describe
from tests.sweep.tiny import FEDPROX, SPACE, TINY, write_space
from tests.test_configs import stop_after_round_1

REPO = Path(__file__).resolve().parents[2]


def sweep_args(tmp_path, space=SPACE, trials=2, extra=()):
    path = write_space(tmp_path / "space.yaml", space)
    return ["--config", FEDPROX, "--space", str(path), "--trials", str(trials), "--objective", "val/acc_mean",
            "--seeds", "0", "--out", str(tmp_path / "sweep"), "--", *TINY, *extra]  # fmt: skip


def test_a_refused_space_runs_no_trial(tmp_path, capsys):
    bad = {**SPACE, "model.init_args.widht": {"type": "int", "low": 2, "high": 4}}
    assert main(sweep_args(tmp_path, bad)) == 2
    out = capsys.readouterr().out
    assert "refused" in out and "model.init_args.widht: not a key of the parsed config" in " ".join(out.split())
    assert not (tmp_path / "sweep" / "trials").exists() and not (tmp_path / "sweep" / "sweep.json").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"objective": "val/auc_mean"}, "produces no metric 'auc'"),
        ({"space": {k: v for k, v in SPACE.items() if k != "data.init_args.val_fraction"}}, "no validation split"),
    ],
)
def test_an_objective_never_logged_is_refused_before_any_trial(tmp_path, change, message):
    args = sweep_args(tmp_path, change.get("space", SPACE))
    if "objective" in change:
        args[args.index("--objective") + 1] = change["objective"]
    with pytest.raises(ValueError, match=message):
        plan_from(*split(args))


def split(args):
    cut = args.index("--")
    return build_parser().parse_args(args[:cut]), args[cut + 1 :]


def dead_owner() -> Owner:
    here = this_process()
    return Owner(here.host, here.boot, here.pid, "a start time that is not this process's")


def test_a_trial_whose_worker_died_continues_from_its_checkpoint_to_the_uninterrupted_state(tmp_path, monkeypatch):
    plan, _ = plan_from(*split(sweep_args(tmp_path, extra=["--federation.rounds=3"])))
    plan.write()
    study = load_study(plan)
    check_plan(study, plan)
    # a worker took trial 0, trained its first round (checkpoint written) and died in the second
    trial = study.ask(distributions(plan.space))
    for key, value in dead_owner().attrs().items():
        trial.set_user_attr(key, value)
    values = trial_values(study.trials[0], plan.space.fixed)
    stop_after_round_1(trial_args(plan, 0, values), monkeypatch)
    run = trial_dir(plan, 0)
    assert (run / "checkpoints").is_dir() and not (run / "summary.json").exists()

    assert work(plan) == 2  # the restarted sweep's worker: continues trial 0, then samples and runs trial 1
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1] and {t.state for t in trials} <= {TrialState.COMPLETE,
                                                                                  TrialState.PRUNED}  # fmt: skip
    assert trials[0].params == values_without_fixed(values, plan)
    assert json.loads((run / "resume_changes.json").read_text())[0]["after_round"] == 1  # resumed, not restarted
    reference = train(run_args(plan, values, tmp_path / "reference", "trial-0000", None))
    assert describe(run)["sha256"] == describe(tmp_path / "reference" / "trial-0000")["sha256"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["summary"] == reference["summary"] and summary["clients"] == reference["clients"]
    assert trials[0].value == summary["selection"]["value"] == reference["selection"]["value"]


def values_without_fixed(values, plan):
    return {k: v for k, v in values.items() if k not in plan.space.fixed}


def test_a_pruned_trial_stops_early_and_its_run_directory_says_so(tmp_path):
    from optuna.trial import create_trial

    plan, _ = plan_from(*split(sweep_args(tmp_path, trials=6, extra=["--federation.rounds=3"])))
    plan.write()
    study = load_study(plan)
    check_plan(study, plan)
    dists = distributions(plan.space)
    for _ in range(5):  # five earlier trials that were far better at every round: the median pruner's startup
        study.add_trial(create_trial(value=1.0, params={"model.init_args.lr": 0.1, "trainer.callbacks[FedProx].mu":
                        0.01}, distributions=dists, intermediate_values={1: 1.0, 2: 1.0, 3: 1.0}))  # fmt: skip
    with pytest.warns(UserWarning, match="stopped before round 2: pruned by the sweep"):
        assert work(plan) == 1
    pruned = study.get_trials()[-1]
    assert pruned.state == TrialState.PRUNED and list(pruned.intermediate_values) == [1]
    summary = json.loads((trial_dir(plan, pruned.number) / "summary.json").read_text())
    assert summary["sweep"] == {"study": plan.study, "trial": 5, "pruned": True, "pruned_after_round": 1}
    assert summary["rounds"] == 1 and "pruned by the sweep" in summary["stopped"]


def test_every_file_column_and_trial_attribute_of_a_sweep_is_documented(tmp_path):
    from fl_lightning.tools.sweep.owners import PREFIX
    from fl_lightning.tools.sweep.results import write_live

    plan, _ = plan_from(*split(sweep_args(tmp_path, trials=2)))
    plan.write()
    study = load_study(plan)
    check_plan(study, plan)
    work(plan)
    write_live(plan, study, study.get_trials())
    page = (REPO / "docs" / "reference" / "run-directory.md").read_text()
    out = tmp_path / "sweep"
    names = {p.name for p in out.iterdir()} - {"space.yaml"}
    names |= set((out / "sweep_results.csv").read_text().splitlines()[0].split(",")) - set(SPACE)
    names |= {k.removeprefix(PREFIX) for t in study.get_trials() for k in t.user_attrs}
    names |= set(json.loads((trial_dir(plan, 0) / "summary.json").read_text())["sweep"])
    assert sorted(n for n in names if f"`{n}`" not in page and f"`{n}/`" not in page) == []


def test_a_grid_sweep_visits_each_point_once_and_ends_when_the_grid_is_used_up(tmp_path):
    space = {"data.init_args.val_fraction": 0.25, "model.init_args.lr": {"type": "categorical", "choices": [0.05, 0.1]}}
    args = sweep_args(tmp_path, space=space, trials=2)
    args[args.index("--trials") :] = ["--trials", "2", "--sampler", "grid", *args[args.index("--trials") + 2 :]]
    plan, _ = plan_from(*split(args))
    plan.write()
    study = load_study(plan)
    check_plan(study, plan)
    assert work(plan) == 2  # the second tell uses up the grid: Optuna's grid sampler would stop() and raise there
    trials = study.get_trials()
    assert sorted(t.params["model.init_args.lr"] for t in trials) == [0.05, 0.1]
    assert {t.state for t in trials} == {TrialState.COMPLETE}


def test_the_command_reruns_the_best_configuration_and_compares_its_test_scores(tmp_path, capsys):
    args = sweep_args(tmp_path, trials=2)
    args[args.index("--seeds") + 1] = "2"
    assert main(args) == 0
    out = tmp_path / "sweep"
    study = load_study(Plan.read(out / "sweep.json"))
    best = study.best_trial
    reruns = [json.loads((out / "best" / f"seed-{k}" / "summary.json").read_text()) for k in range(2)]
    # seed 0 is the trials' seed: its re-run repeats the best trial, validation value and chosen round
    assert reruns[0]["selection"]["value"] == best.value
    assert reruns[0]["selection"]["round"] == best.user_attrs["fl_lightning:round"]
    assert "sweep" not in reruns[0]  # a re-run is not a trial: never pruned
    table = (out / "best" / "comparison" / "comparison.md").read_text()
    assert "2 (0, 1)" in table and "chosen on (validation)" in table
    printed = " ".join(capsys.readouterr().out.split())
    assert f"best trial {best.number}: val/acc_mean = {best.value:.4f} on validation" in printed
    assert (out / "sweep_results.csv").read_text().count("\n") == 3
