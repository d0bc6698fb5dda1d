"""The study: its storage and names, the grid sampler's space, and a restart refused when it would change the sweep."""

from __future__ import annotations

import dataclasses

import pytest

from fl_lightning.tools.sweep.space import Param
from fl_lightning.tools.sweep.study import (
    Plan,
    check_plan,
    default_storage,
    default_study_name,
    grid_size,
    grid_space,
    load_study,
    make_pruner,
    make_sampler,
    open_storage,
)
from tests.sweep.tiny import SPACE


def plan(tmp_path, **changes) -> Plan:
    import yaml

    base = Plan(out=str(tmp_path), storage=default_storage(tmp_path), study="s", train_args=["--config", "c.yaml"],
                space_text=yaml.safe_dump(SPACE), space_path="space.yaml", objective="val/acc_mean",
                direction="maximize", sampler="tpe", pruner="median", seed=0, callbacks=None, wandb=False, trials=4,
                workers=1, seeds=0)  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_default_names():
    assert default_study_name(["configs/fedprox_digits.yaml"], "sweeps/fedprox.yaml") == "fedprox_digits-fedprox"
    assert default_study_name(["a.yaml", "b.yaml"], "s.yaml") == "a+b-s"


def test_the_default_storage_is_an_sqlite_file_in_the_sweep_directory(tmp_path):
    assert default_storage(tmp_path) == f"sqlite:///{tmp_path.resolve()}/study.db"
    load_study(plan(tmp_path))
    assert (tmp_path / "study.db").is_file()


def test_a_bad_storage_url_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="--storage nosuchdb://x: cannot open it"):
        open_storage("nosuchdb://x")


def test_grid_space_and_size():
    params = (Param("a", "categorical", choices=(1, 2, 3)), Param("b", "int", 1, 4))
    assert grid_space(params) == {"a": [1, 2, 3], "b": [1, 2, 3, 4]} and grid_size(params) == 12
    with pytest.raises(ValueError, match="--sampler grid: c is a log_uniform range"):
        grid_space((Param("c", "log_uniform", 0.1, 1),))


def test_samplers_and_pruners_by_name():
    assert type(make_sampler("random", (), 0)).__name__ == "RandomSampler"
    assert type(make_pruner("none")).__name__ == "NopPruner"
    with pytest.raises(ValueError, match="--sampler 'cmaes'"):
        make_sampler("cmaes", (), 0)
    with pytest.raises(ValueError, match="--pruner 'hyperband'"):
        make_pruner("hyperband")


def test_a_plan_round_trips_through_its_file(tmp_path):
    p = plan(tmp_path)
    assert Plan.read(p.write()) == p
    assert [q.key for q in p.space.params] == ["model.init_args.lr", "trainer.callbacks[FedProx].mu"]


def test_a_restart_may_change_the_counts_but_not_what_is_sampled_or_scored(tmp_path):
    first = plan(tmp_path)
    study = load_study(first)
    check_plan(study, first)
    check_plan(study, plan(tmp_path, trials=10, workers=3, seeds=5))  # extend, more workers: the same sweep
    with pytest.raises(ValueError, match=r"(?s)--study s was started with other settings.*objective: 'val/acc_mean' "
                                         r"-> 'val/loss'.*only trials, workers, seeds"):  # fmt: skip
        check_plan(study, plan(tmp_path, objective="val/loss", direction="minimize"))
    with pytest.raises(ValueError, match="space_text"):
        check_plan(study, plan(tmp_path, space_text="x: {type: uniform, low: 0, high: 1}\n"))


def test_a_study_made_by_something_else_is_refused(tmp_path):
    p = plan(tmp_path)
    study = load_study(p)
    study.ask()
    with pytest.raises(ValueError, match="already holds 1 trials that no sweep of this command made"):
        check_plan(study, p)


def test_each_trial_is_sampled_with_its_own_seed_so_workers_do_not_draw_alike(tmp_path):
    from fl_lightning.tools.sweep.worker import distributions

    def draws(directory, numbers):
        p = plan(directory, sampler="random")
        directory.mkdir()
        return [load_study(p, trial=n).ask(distributions(p.space)).params for n in numbers]

    first = draws(tmp_path / "a", [0, 1])
    assert first[0] != first[1]  # two workers, each with a sampler of its own
    assert draws(tmp_path / "b", [0, 1]) == first  # and reproducible


def test_workers_sampling_a_grid_in_turn_visit_each_point_once(tmp_path):
    from fl_lightning.tools.sweep.worker import distributions

    grid = {"model.init_args.lr": {"type": "flamby_grid", "low_k": -5, "high_k": -2}}
    import yaml

    p = plan(tmp_path, sampler="grid", space_text=yaml.safe_dump(grid))
    for n in range(4):  # each trial asked by a sampler of its own, as each worker builds one per trial
        trial = load_study(p, trial=n).ask(distributions(p.space))
        load_study(p).tell(trial.number, 0.5)  # as the worker tells: the grid's last point ends no optimize loop
    lrs = [t.params["model.init_args.lr"] for t in load_study(p).get_trials()]
    assert sorted(lrs) == list(p.space.params[0].choices)


def test_workers_share_the_cores(monkeypatch):
    from fl_lightning.tools.sweep.threads import worker_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert (worker_threads(1), worker_threads(2), worker_threads(3), worker_threads(16)) == ("8", "4", "2", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads(2) == "3"
