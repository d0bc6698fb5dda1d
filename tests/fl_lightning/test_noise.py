"""No noise a user cannot act on: Lightning's logging-interval warning per client, W&B's "anonymous" line per run."""

from __future__ import annotations

import signal
import warnings

import lightning as L
import pytest
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.loggers import CSVLogger

from fl_lightning import FederationConfig, local_federation
from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.outputs.tracking import RoundTracker, WandbArgs
from fl_lightning.outputs.wandb_init import wandb_init_args
from tests.conftest import tiny_data, tiny_model


def test_logging_interval_warning_is_not_shown_but_other_warnings_are(tmp_path):
    data = tiny_data(num_clients=3)  # 1-4 batches per client, below log_every_n_steps = 50
    trainer = L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": CSVLogger(tmp_path / "logs")})
    cfg = FederationConfig(rounds=1, output_dir=str(tmp_path), quiet=True, plots=False, checkpoint_every=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # what a first run sees: every warning once
        local_federation(cfg, tiny_model(data), data, trainer, seed=0).run()
        warnings.warn("another possible user mistake", PossibleUserWarning, stacklevel=1)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "smaller than the logging interval" in m], messages
    assert "another possible user mistake" in messages


@pytest.fixture
def offline_wandb(monkeypatch):
    """No network, no prompts, and a hard time limit (a hung W&B service fails the test, not the suite)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")

    def expire(signum, frame):
        raise TimeoutError("W&B took over 120 s (a service hang?)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_wandb_does_not_print_the_anonymous_setting_line(tmp_path, capfd, offline_wandb):
    tracker = RoundTracker([WandbArgs(dict(TRAINER_DEFAULTS["logger"]["init_args"]))])  # the CLI's default logger
    tracker.start(tmp_path, {"seed": 0})
    tracker.log_round(1, {"eval/global/acc": 0.5})
    tracker.finish()
    out, err = capfd.readouterr()
    assert "anonymous setting" not in out + err
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))  # the run itself was still written


def test_an_explicit_anonymous_choice_is_kept(tmp_path):
    assert wandb_init_args({"anonymous": True}, tmp_path)["anonymous"] == "allow"
    assert "anonymous" not in wandb_init_args({"anonymous": None}, tmp_path)
