"""Run directories and scripts from before the layout step: old module paths import, old run directories resume."""

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fl_lightning.cli import main
from fl_lightning.outputs.config_diff import flatten
from fl_lightning.startup.moved import MOVED, REMOVED_IN, canonical_class_path
from tests.anchors.runs import describe
from tests.test_configs import metrics_without_timings, stop_after_round_1, tiny_args

FEDER = Path("configs/feder_digits.yaml")
OLD_PATHS = {  # what a FedER run's config.yaml said before the move
    "callbacks.feder.gan.": "fl_lightning.models.gan.",
    "class_path: callbacks.ExperienceReplay": "class_path: callbacks.experience_replay.ExperienceReplay",
}
FAST_GAN = ["--trainer.callbacks.init_args.gan.epochs=1", "--trainer.callbacks.init_args.buffer_size=8"]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_imports_the_moved_module_with_a_warning(old):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert any(
        issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message) and REMOVED_IN in str(w.message)
        for w in caught
    ) or (
        old in importlib.sys.modules  # imported earlier in this process: no second warning
    )


@pytest.mark.parametrize("old", ["fl_lightning.compare", "fl_lightning.wandb_sync", "fl_lightning.membership_audit"])
def test_an_old_command_runs_the_moved_command_saying_its_new_name_and_when_the_old_one_goes(old):
    proc = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, cwd=Path.cwd())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"usage: python -m {MOVED[old]}" in proc.stdout.replace("\n", " ") or MOVED[old] in proc.stdout
    assert f"python -m {old} is now python -m {MOVED[old]}; the old command goes in {REMOVED_IN}" in proc.stderr


def test_an_unknown_old_path_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fl_lightning.no_such_module")


def test_saved_class_paths_compare_as_todays():
    assert canonical_class_path("fl_lightning.models.gan.ConditionalGenerator") == (
        "callbacks.feder.gan.ConditionalGenerator"
    )
    assert canonical_class_path("callbacks.FedProx") == "callbacks.fedprox.FedProx"
    assert canonical_class_path("no_such_package.Thing") == "no_such_package.Thing"
    old = {"trainer": {"callbacks": [{"class_path": "callbacks.experience_replay.ExperienceReplay", "init_args": {
        "gan": {"generator": {"class_path": "fl_lightning.models.gan.ConditionalGenerator"}}}}]}}  # fmt: skip
    new = {"trainer": {"callbacks": [{"class_path": "callbacks.feder.experience_replay.ExperienceReplay", "init_args": {
        "gan": {"generator": {"class_path": "callbacks.feder.gan.ConditionalGenerator"}}}}]}}  # fmt: skip
    assert flatten(old) == flatten(new)


@pytest.mark.parametrize("resume_with", ["saved config", "shipped config"])
def test_a_run_directory_from_before_the_move_resumes_to_the_uninterrupted_state(resume_with, tmp_path, monkeypatch):
    main([*tiny_args(FEDER, tmp_path, "uninterrupted"), *FAST_GAN])
    stop_after_round_1([*tiny_args(FEDER, tmp_path, "stopped"), *FAST_GAN], monkeypatch)
    run = tmp_path / "stopped"
    text = (run / "config.yaml").read_text()
    for new, old in OLD_PATHS.items():
        assert new in text, new
        text = text.replace(new, old)
    (run / "config.yaml").write_text(text)  # as the run directory was written before the move
    if resume_with == "saved config":
        args = ["--config", str(run / "config.yaml"), "--federation.run_name=stopped"]
    else:
        args = [*tiny_args(FEDER, tmp_path, "stopped"), *FAST_GAN]
    main([*args, "--federation.resume=last"])
    assert describe(run)["sha256"] == describe(tmp_path / "uninterrupted")["sha256"]
    assert metrics_without_timings(run / "metrics.csv") == metrics_without_timings(
        tmp_path / "uninterrupted" / "metrics.csv"
    )
