"""The W&B run's ``wandb.init`` arguments from the config's WandbLogger arguments, and how the tracker takes them."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.outputs import tracking
from fl_lightning.outputs.wandb_init import is_offline, wandb_init_args

DEFAULT = TRAINER_DEFAULTS["logger"]


@pytest.fixture(autouse=True)
def no_wandb_env(monkeypatch):
    for name in ("WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


def test_the_default_logger_writes_into_the_run_directory_offline(tmp_path):
    init = wandb_init_args(DEFAULT["init_args"], tmp_path)
    assert init == {"project": "fl_lightning", "dir": str(tmp_path), "mode": "offline"}


def test_a_chosen_folder_is_kept_and_dir_is_its_synonym(tmp_path):
    assert wandb_init_args({"save_dir": "/elsewhere"}, tmp_path)["dir"] == "/elsewhere"
    assert wandb_init_args({"dir": Path("/other")}, tmp_path)["dir"] == "/other"
    assert wandb_init_args({"save_dir": ".", "dir": None}, tmp_path)["dir"] == str(tmp_path)


def test_the_resumed_run_id_wins_over_the_configured_one(tmp_path):
    assert wandb_init_args({"version": "v1"}, tmp_path)["id"] == "v1"
    assert wandb_init_args({"id": "i1"}, tmp_path)["id"] == "i1"
    resumed = wandb_init_args({"version": "v1"}, tmp_path, run_id="resumed")
    assert resumed["id"] == "resumed" and resumed["resume"] == "allow"
    assert "id" not in wandb_init_args({}, tmp_path)  # W&B makes one


def test_other_arguments_reach_wandb_init_and_unset_ones_stay_out(tmp_path):
    init = wandb_init_args({"tags": ["a"], "entity": "me", "group": None, "notes": None}, tmp_path)
    assert init["tags"] == ["a"] and init["entity"] == "me"
    assert "group" not in init and "notes" not in init
    assert wandb_init_args({"offline": True, "mode": "online"}, tmp_path)["mode"] == "online"  # explicit mode wins


def test_project_falls_back_as_wandb_logger_does(tmp_path, monkeypatch):
    assert wandb_init_args({}, tmp_path)["project"] == "lightning_logs"
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    assert wandb_init_args({}, tmp_path)["project"] == "from-env"
    assert wandb_init_args({"project": "mine"}, tmp_path)["project"] == "mine"


def test_wandb_disabled_is_not_turned_into_offline(tmp_path, monkeypatch):
    assert is_offline({"offline": True})
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert "mode" not in wandb_init_args({"offline": True}, tmp_path)
    assert not is_offline({"offline": True})
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert is_offline({"offline": False})


@pytest.mark.parametrize("key,value", [("log_model", True), ("prefix", "x"), ("checkpoint_name", "c")])
def test_lightning_only_arguments_are_refused_by_name(tmp_path, key, value):
    with pytest.raises(ValueError, match=f"trainer.logger.init_args.{key}="):
        wandb_init_args({key: value}, tmp_path)
    wandb_init_args({key: {"log_model": False, "prefix": "", "checkpoint_name": None}[key]}, tmp_path)  # defaults


def trainer(logger):
    return L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": logger})


def test_the_config_s_wandb_logger_becomes_arguments_and_other_loggers_stay(tmp_path):
    csv = CSVLogger(tmp_path)
    spec = [DEFAULT, {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}]
    shared = trainer([WandbLogger(offline=True), csv])
    tracker = tracking.RoundTracker.take_from(shared, spec)
    assert shared.loggers == []
    assert tracker.loggers[0] == tracking.WandbArgs(DEFAULT["init_args"]) and tracker.loggers[1] is csv
    extra = {**DEFAULT, "dict_kwargs": {"entity": "me"}}
    assert tracking.RoundTracker.take_from(trainer(WandbLogger()), extra).loggers[0].init_args["entity"] == "me"


def test_a_wandb_logger_subclass_or_one_built_without_config_is_used_as_built(tmp_path):
    class Mine(WandbLogger):
        pass

    mine = Mine(offline=True)
    spec = {"class_path": f"{__name__}.Mine", "init_args": {}}
    assert tracking.RoundTracker.take_from(trainer(mine), spec).loggers == [mine]
    built = WandbLogger(offline=True)
    assert tracking.RoundTracker.take_from(trainer(built), None).loggers == [built]


def test_a_python_built_logger_is_opened_as_it_is_and_a_resume_under_another_id_warns(tmp_path, monkeypatch):
    opened = []

    class Run:
        id, offline = "its-own", False

        def define_metric(self, *a, **k):
            pass

        config = type("Config", (), {"update": lambda self, *a, **k: None})()

    monkeypatch.setattr(WandbLogger, "experiment", property(lambda self: opened.append(self) or Run()))
    logger = WandbLogger(offline=True, save_dir=str(tmp_path))
    tracker = tracking.RoundTracker([logger])
    with pytest.warns(UserWarning, match="give it id='resumed'"):
        tracker.start(tmp_path, None, run_id="resumed")
    assert opened == [logger] and tracker.run_id() == "its-own"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracking.RoundTracker([WandbLogger(offline=True, id="same")]).start(tmp_path, None, run_id="same")
