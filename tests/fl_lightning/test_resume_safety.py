"""Resume safety: exact continuation with RNG use during training, config checks, exclusive run directories."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from datamodules import DigitsFederated
from fl_lightning.cli import build_cli, config_yaml
from fl_lightning.outputs.checkpoint import checkpoint_path, save_checkpoint
from fl_lightning.outputs.config_diff import diff_configs
from fl_lightning.outputs.resume import check_clients_match, check_resume_config, resolve_resume
from fl_lightning.outputs.run_dir import RunDirectory, RunDirectoryInUse
from tests.conftest import build_federation, tiny_data, tiny_model
from tests.test_configs import fake_medmnist

REPO = Path(__file__).resolve().parents[2]


class RandomFlipDigits(DigitsFederated):
    """Digits whose training batches are flipped at random with torch's global generator (random augmentation)."""

    def _train_loader(self, x, y, key, steps):
        loader = super()._train_loader(x, y, key, steps)
        loader.collate_fn = _random_flip
        return loader


def _random_flip(samples):
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    flip = torch.rand(len(x)) < 0.5  # the global generator, as torchvision's transforms use it
    x[flip] = x[flip].flip(-1)
    return x, y


def _dropout_model(data):
    model = tiny_model(data)
    model.net.classifier = nn.Sequential(nn.Dropout(0.5), model.net.classifier)
    return model


def _setup(kind: str):
    if kind == "dropout":
        data = tiny_data()
        return data, _dropout_model(data)
    data = RandomFlipDigits(num_clients=3, image_size=8, max_samples_per_client=40, batch_size=8, seed=0)
    return data, tiny_model(data)


@pytest.mark.parametrize("kind", ["dropout", "random_augmentation"])
def test_resume_is_exact_when_training_draws_from_the_global_generator(tmp_path, kind):
    """A fresh process (fresh Trainer) resumed after round 2 ends with the uninterrupted run's weights.

    Failed before: Lightning's first fit on a Trainer creates one loader iterator, every later fit two, and each
    drew a base seed from the global generator, so the resumed run was one draw behind from its first fit on.
    """
    data, model = _setup(kind)
    full = build_federation(tmp_path, data=data, model=model, rounds=4, keep_checkpoints=0, run_name="full")
    full.run()
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    data, model = _setup(kind)
    torch.manual_seed(1234)  # whatever the new process's generator holds, the checkpoint's state must win
    resumed = build_federation(
        tmp_path,
        data=data,
        model=model,
        rounds=4,
        keep_checkpoints=0,
        run_name="resumed",
        resume=str(checkpoint_path(tmp_path / "resumed", 2)),
    )
    resumed.run()
    for key, value in full.groups[0].state.items():
        assert torch.equal(value, resumed.groups[0].state[key]), key
    assert full.run_dir.client_rows == resumed.run_dir.client_rows


# ---------------------------------------------------------------------------------------- config comparison (unit)
SMALL = [
    "--config", "configs/fedavg_digits.yaml",
    "--trainer.logger=false",
    "--federation.rounds=3",
    "--federation.progress=false",
    "--federation.plots=false",
    "--data.max_samples_per_client=40",
    "--data.image_size=8",
    "--data.num_clients=3",
    "--model.width=4",
]  # fmt: skip


def _saved(*args: str) -> dict:
    """The config as a run with ``args`` saves it (its config.yaml, parsed)."""
    cli = build_cli([*SMALL, *args])
    return yaml.safe_load(config_yaml(cli.parser, cli.config))


def _new(*args: str) -> dict:
    """The config as a command with ``args`` resolves it (what the Federation gets as ``config_dict``)."""
    return build_cli([*SMALL, *args]).config.clone().as_dict()


def _configs(*extra: str) -> tuple[dict, dict]:
    """The saved config of the small run, and the config of the next command with ``extra``."""
    return _saved(), _new(*extra)


def test_the_saved_config_matches_the_same_command(monkeypatch):
    monkeypatch.chdir(REPO)
    diff = diff_configs(*_configs())
    assert diff.allowed == {} and diff.refused == {}


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["--data.seed=1"], "data.init_args.seed"),
        (["--data.partition=dirichlet"], "data.init_args.partition"),
        (["--model.lr=0.2"], "model.init_args.lr"),
        (["--federation.mode=local"], "federation.mode"),
        (["--federation.local_epochs=2"], "federation.local_epochs"),
        (["--seed_everything=3"], "seed_everything"),
    ],
)
def test_settings_that_change_training_are_refused(monkeypatch, extra, key):
    monkeypatch.chdir(REPO)
    diff = diff_configs(*_configs(*extra))
    assert list(diff.refused) == [key] and diff.allowed == {}


def test_an_added_callback_is_refused_with_its_arguments(monkeypatch):
    monkeypatch.chdir(REPO)
    diff = diff_configs(*_configs("--trainer.callbacks+=callbacks.FedProx"))
    assert diff.refused == {
        "trainer.callbacks": (None, ["callbacks.FedProx"]),
        "trainer.callbacks[FedProx].mu": ("<absent>", 0.01),
    }


def test_a_changed_callback_argument_is_named(monkeypatch):
    """Failed before: the whole callbacks list was shown as the difference."""
    monkeypatch.chdir(REPO)
    prox = ["--trainer.callbacks+=callbacks.FedProx", "--trainer.callbacks.mu=0.01"]
    saved = _saved(*prox)
    diff = diff_configs(saved, _new("--trainer.callbacks+=callbacks.FedProx", "--trainer.callbacks.mu=0.1"))
    assert diff.refused == {"trainer.callbacks[FedProx].mu": (0.01, 0.1)}
    assert diff_configs(saved, _new(*prox)).refused == {}


def test_callback_arguments_left_at_none_compare_equal_to_the_saved_yaml(monkeypatch):
    """The saved YAML drops a callback's ``None`` arguments (FedOpt's initial_accumulator, FedER's lpips_weights).

    Failed before: such a run could never be resumed, not even with its own config.yaml.
    """
    monkeypatch.chdir(REPO)
    for config in ("configs/fedadam_digits_dirichlet.yaml", "configs/feder_digits.yaml"):
        cli = build_cli([*SMALL, "--config", config])
        new = cli.config.clone().as_dict()
        assert "initial_accumulator" in str(new) or "lpips_weights" in str(new)
        without_none = yaml.safe_load(cli.parser.dump(cli.config, skip_check=True))  # run directories until now
        assert diff_configs(without_none, new).refused == {}, config
        assert diff_configs(_saved("--config", config), new).refused == {}, config


def test_the_saved_config_keeps_none_values_so_it_reproduces_the_run(monkeypatch, tmp_path):
    """Failed before: MedMNIST's ``channels: null`` was left out and came back as the digits' default 1."""
    monkeypatch.chdir(REPO)
    data = fake_medmnist(tmp_path / "m.npz")
    cli = build_cli(["--config", "configs/fedavg_medmnist.yaml", "--trainer.logger=false", f"--data.path={data}"])
    assert cli.config.data.init_args.channels is None
    saved = tmp_path / "config.yaml"
    saved.write_text(config_yaml(cli.parser, cli.config))
    again = build_cli(["--config", str(saved)])
    assert again.config.data.init_args.channels is None
    assert diff_configs(yaml.safe_load(saved.read_text()), again.config.clone().as_dict()).refused == {}


def test_the_order_and_the_repeats_of_callbacks_count():
    first = {"class_path": "callbacks.FedProx", "init_args": {"mu": 0.1}}
    second = {"class_path": "callbacks.FedBN"}
    diff = diff_configs({"trainer": {"callbacks": [first, second]}}, {"trainer": {"callbacks": [second, first]}})
    assert list(diff.refused) == ["trainer.callbacks"]
    twice = {"trainer": {"callbacks": [first, {**first, "init_args": {"mu": 0.2}}]}}
    diff = diff_configs(twice, {"trainer": {"callbacks": [first, first]}})
    assert diff.refused == {"trainer.callbacks[FedProx#2].mu": (0.2, 0.1)}


def test_allow_listed_settings_may_change(monkeypatch):
    monkeypatch.chdir(REPO)
    extra = ["--federation.rounds=5", "--federation.transport=serialized", "--federation.eval_every=2",
             "--federation.run_name=x", "--federation.resume=last", "--trainer.logger=true"]  # fmt: skip
    diff = diff_configs(*_configs(*extra))
    assert diff.refused == {}
    assert set(diff.allowed) >= {"federation.rounds", "federation.transport", "federation.eval_every"}
    assert diff.allowed["federation.rounds"] == (3, 5)


def test_rounds_may_not_change_under_a_schedule_that_depends_on_them(monkeypatch):
    monkeypatch.chdir(REPO)
    schedule = ["--trainer.callbacks+=callbacks.LRSchedule", "--trainer.callbacks.kind=cosine"]
    assert list(diff_configs(_saved(*schedule), _new(*schedule, "--federation.rounds=6")).refused) == [
        "federation.rounds"
    ]
    exponential = ["--trainer.callbacks+=callbacks.LRSchedule", "--trainer.callbacks.kind=exponential"]
    assert list(diff_configs(_saved(*exponential), _new(*exponential, "--federation.rounds=6")).allowed) == [
        "federation.rounds"
    ]


def test_a_key_only_one_side_has_is_a_difference():
    diff = diff_configs({"data": {"init_args": {"seed": 0}}}, {"data": {"init_args": {"seed": 0, "new_flag": True}}})
    assert diff.refused == {"data.init_args.new_flag": ("<absent>", True)}
    # None is what the saved YAML leaves out: no difference
    assert diff_configs({"a": 1}, {"a": 1, "b": None}).refused == {}


# ------------------------------------------------------------------------------------ resolve_resume (unit)
def _fake_run(out: Path, name: str, config: dict, mtime: float) -> Path:
    run = out / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    save_checkpoint(checkpoint_path(run, 1), {"round": 1, "data": {"c0": 1, "__pooled__": 0}})
    os.utime(checkpoint_path(run, 1), (mtime, mtime))
    return run


CFG = {"seed_everything": 0, "model": {"init_args": {"lr": 0.1}}, "federation": {"rounds": 3}}


def test_resume_refuses_a_named_run_with_other_settings(tmp_path):
    _fake_run(tmp_path, "exp", CFG, 1000)
    new = {**CFG, "model": {"init_args": {"lr": 0.2}}, "federation": {"rounds": 9}}
    with pytest.raises(ValueError, match=r"(?s)model\.init_args\.lr: 0\.1 -> 0\.2.*federation\.rounds") as exc:
        resolve_resume("last", tmp_path, "exp", new)
    assert "federation.rounds: 3" not in str(exc.value)  # allowed: not among the refused keys
    run_dir, _, state = resolve_resume("last", tmp_path, "exp", {**CFG, "federation": {"rounds": 9}})
    assert run_dir == tmp_path / "exp" and state["round"] == 1
    assert check_resume_config(run_dir, {**CFG, "federation": {"rounds": 9}}) == {"federation.rounds": (3, 9)}
    with pytest.raises(ValueError, match=r"model\.init_args\.lr"):  # a checkpoint file or directory is checked too
        resolve_resume(str(checkpoint_path(tmp_path / "exp", 1)), tmp_path, None, new)


def test_resume_last_without_a_name_picks_only_a_matching_run(tmp_path):
    _fake_run(tmp_path, "old-match", CFG, 1000)
    _fake_run(tmp_path, "new-other-seed", {**CFG, "seed_everything": 1}, 2000)
    run_dir, _, _ = resolve_resume("last", tmp_path, None, CFG)
    assert run_dir == tmp_path / "old-match"
    # without a config to compare (a Federation built in Python) the newest run is taken, as before
    assert resolve_resume("last", tmp_path, None, None)[0] == tmp_path / "new-other-seed"


def test_resume_last_without_a_name_lists_the_candidates_when_none_matches(tmp_path):
    _fake_run(tmp_path, "a", {**CFG, "seed_everything": 1}, 1000)
    _fake_run(tmp_path, "b", {**CFG, "model": {"init_args": {"lr": 0.5}}}, 2000)
    with pytest.raises(ValueError, match=r"(?s)candidates.*b: differs in model\.init_args\.lr.*a: differs in seed"):
        resolve_resume("last", tmp_path, None, CFG)


def test_a_checkpoint_of_other_clients_is_refused_naming_both_lists():
    state = {"data": {"site0": 1, "site1": 1, "site2": 1, "__pooled__": 0}, "groups": []}
    check_clients_match(state, ["site0", "site1", "site2"])
    with pytest.raises(ValueError, match=r"3 clients \[site0, site1, site2\] but the data has 4 clients .*site3"):
        check_clients_match(state, ["site0", "site1", "site2", "site3"])
    check_clients_match({"runtime": {"data": {"a": 0, "__pooled__": 0}}}, ["a"])  # the client/server layout
    legacy = {"groups": [{"members": ["__pooled__"]}, {"members": ["a", "b"]}]}
    with pytest.raises(ValueError, match=r"\[a, b\].*\[a\]"):
        check_clients_match(legacy, ["a"])


# ------------------------------------------------------------------------------------ run directories (unit)
def test_an_existing_run_name_is_refused(tmp_path):
    RunDirectory(tmp_path, "exp")
    with pytest.raises(FileExistsError, match=r"exp exists already.*resume"):
        RunDirectory(tmp_path, "exp")
    # generated names never collide
    assert RunDirectory(tmp_path, suffix="x").path != RunDirectory(tmp_path, suffix="x").path


def test_concurrent_runs_with_one_name_get_one_directory(tmp_path):
    results: list[str] = []

    def create() -> None:
        try:
            RunDirectory(tmp_path, "same")
            results.append("ok")
        except FileExistsError:
            results.append("refused")

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["ok"] + ["refused"] * 7


def test_a_run_directory_held_by_another_process_is_refused(tmp_path):
    run = tmp_path / "busy"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from fl_lightning.outputs.run_dir import claim; from pathlib import Path; import time; "  # noqa: E501
         f"claim(Path({str(run)!r})); print('held', flush=True); time.sleep(60)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryInUse, match=rf"busy is in use by another process \(pid {holder.pid}\)"):
            RunDirectory.reopen(run, [], [])
        with pytest.raises(RunDirectoryInUse):  # no checkpoint yet, but a live run: not started afresh
            RunDirectory(tmp_path, "busy")
    finally:
        holder.kill()
        holder.wait()
    RunDirectory.reopen(run, [], [])  # the lock died with its process: nothing stale


def test_orphan_temporary_files_are_removed_when_a_run_is_reopened(tmp_path):
    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    orphans = [run / "checkpoints" / ".round-00004.ckpt.k3j2.tmp", run / ".metrics.csv.x9.tmp"]
    for p in orphans:
        p.write_bytes(b"half")
    kept = run / "checkpoints" / "round-00003.ckpt"
    kept.write_bytes(b"x")
    RunDirectory.reopen(run, [], [])
    assert not any(p.exists() for p in orphans) and kept.exists()


# ---------------------------------------------------------------------------- messages that say what to do
class Stop(Exception):
    """A run stopped in its first round, before any checkpoint."""


def _stopped_before_the_first_checkpoint(tmp_path, monkeypatch):
    from fl_lightning.server.federation import Federation

    def stop(federation, r):
        raise Stop

    with monkeypatch.context() as m:
        m.setattr(Federation, "run_round", stop)
        with pytest.raises(Stop):
            build_federation(tmp_path, run_name="early").run()
    return tmp_path / "early"


def test_a_run_stopped_before_its_first_checkpoint_restarts_by_name(tmp_path, monkeypatch):
    """Failed before: resume said 'no readable round checkpoint', a fresh start 'exists already ... resume'."""
    run = _stopped_before_the_first_checkpoint(tmp_path, monkeypatch)
    assert run.is_dir() and not (run / "checkpoints").exists()
    with pytest.raises(FileNotFoundError, match="holds no round checkpoint .* without --federation.resume"):
        build_federation(tmp_path, run_name="early", resume="last").run()
    left = sorted(p.name for p in run.iterdir() if p.name != ".lock")
    with pytest.warns(UserWarning, match=r"holds no round checkpoint and no live run .* moved to .*early\.stopped-"):
        build_federation(tmp_path, run_name="early").run()
    (aside,) = tmp_path.glob("early.stopped-*")
    assert sorted(p.name for p in aside.iterdir()) == left
    assert (run / "summary.json").is_file() and (run / "checkpoints").is_dir()


def test_a_run_with_only_unreadable_checkpoints_says_so(tmp_path):
    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    checkpoint_path(run, 3).write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning, match="is unreadable"):
        with pytest.raises(FileNotFoundError, match=r"none of the 1 round checkpoints in .* is readable"):
            resolve_resume("last", tmp_path, "r")
    with pytest.raises(FileExistsError, match="exists already"):  # it has checkpoints: never set aside
        RunDirectory(tmp_path, "r")


def test_resuming_with_rounds_below_the_checkpoint_says_so(tmp_path):
    build_federation(tmp_path, run_name="done", rounds=2).run()
    with pytest.warns(
        UserWarning, match=r"federation.rounds=1 but the checkpoint is after round 2: no round is trained"
    ):
        build_federation(tmp_path, run_name="done", rounds=1, resume="last").run()


def test_a_folder_that_is_not_a_run_is_refused_and_left_untouched(tmp_path):
    """Failed before: the folder's files were moved to ``data.stopped-<time>`` as "a run stopped early"."""
    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True)
    (folder / "labels.csv").write_text("a,b\n")
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    with pytest.raises(FileExistsError, match=r"data exists and is not a run directory .* nothing in it was touched"):
        RunDirectory(tmp_path, "data")
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
    assert not list(tmp_path.glob("data.stopped-*"))
    (tmp_path / "empty").mkdir()
    with pytest.warns(UserWarning, match="exists but is empty"):
        RunDirectory(tmp_path, "empty").close()  # an empty folder may still take the run
