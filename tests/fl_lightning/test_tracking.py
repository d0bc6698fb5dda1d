"""Round tracking through the Trainer's loggers: W&B offline (the default), CSV and TensorBoard alternatives."""

import csv
import json
import signal
import traceback
from pathlib import Path

import pytest

from fl_lightning.cli import main
from fl_lightning.outputs.tracking import ROUND_PREFIXES
from tests.test_configs import TINY
from tests.wandb_offline import history_and_config, read_records

CONFIG = "configs/fedavg_digits.yaml"
TINY_LOGGED = [a for a in TINY if not a.startswith("--trainer.logger")]  # keep the CLI's default logger (W&B)
REQUIRED_KEYS = (
    "eval/global/acc",
    "eval/personal/acc",
    "time/train",
    "time/round",
    "throughput/samples_per_s",
    "round/failed_clients",
    "client/site0/train/loss",
)


@pytest.fixture(autouse=True)
def offline_and_bounded(monkeypatch):
    """No network, no prompts, and a hard time limit: a hung W&B service fails the test instead of the suite."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")

    def expire(signum, frame):
        raise TimeoutError("the run with logging took over 120 s (a W&B service hang?)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def run(tmp_path, *extra):
    args = ["--config", CONFIG, *TINY_LOGGED, "--federation.rounds=2"]
    return main([*args, f"--federation.output_dir={tmp_path}", "--federation.run_name=r", *extra])


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def wandb_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def run_id(path: Path) -> str:
    return path.name.removeprefix("run-").removesuffix(".wandb")


def logged_rounds(path: Path) -> list[int]:
    return [int(float(row["round"])) for row in history_and_config(path)[0] if "round" in row]


def resolved_step_metrics(key, metrics):
    """The step metrics W&B may give ``key``: its exact definition if any, else those of every matching glob.

    wandb-core picks one matching glob at random (Go map order), so a key is on a well-defined x-axis only
    when every candidate agrees.
    """
    exact = [m for m in metrics if m.name == key]
    if exact:
        return {m.step_metric for m in exact if m.step_metric}
    return {m.step_metric for m in metrics if m.glob_name and key.startswith(m.glob_name.removesuffix("*"))}


# ------------------------------------------------------------------------------------------------ W&B (default)


def test_wandb_offline_default_logs_rounds_config_and_x_axis(tmp_path):
    run(tmp_path)
    run_dir = tmp_path / "r"
    files = wandb_files(run_dir)
    assert len(files) == 1, list(run_dir.rglob("*"))
    assert not list(Path.cwd().glob(f"wandb/*{run_id(files[0])}*"))  # nothing in the working directory
    history, config, metrics = history_and_config(files[0])

    # history: one row per round, with the round-level and per-client keys
    by_round = {int(float(row["round"])): row for row in history if "round" in row}
    assert sorted(by_round) == [1, 2]
    for row in by_round.values():
        assert set(REQUIRED_KEYS) <= set(row), set(REQUIRED_KEYS) - set(row)

    # ... holding exactly what the run directory's CSVs hold
    rounds_csv = {int(r["round"]): r for r in read_csv(run_dir / "rounds.csv")}
    metrics_csv = {(int(r["round"]), r["client"]): r for r in read_csv(run_dir / "metrics.csv")}
    assert sorted(rounds_csv) == [1, 2]
    for r, row in by_round.items():
        for key in REQUIRED_KEYS[:-1]:
            assert float(json.loads(row[key])) == float(rounds_csv[r][key]), (r, key)
        client = metrics_csv[(r, "site0")]
        assert float(json.loads(row["client/site0/train/loss"])) == float(client["train_loss"])
        assert float(json.loads(row["client/site0/eval/global/acc"])) == float(client["global/acc"])
        assert float(json.loads(row["client/site0/eval/personal/acc"])) == float(client["personal/acc"])

    # config: the resolved config, logged once (one config record), not once per client fit
    assert json.loads(config["federation"])["rounds"] == 2
    assert json.loads(config["federation"])["run_name"] == "r"
    config_records = [
        rec
        for rec in read_records(files[0])
        if rec.WhichOneof("record_type") == "config"
        and any(not (i.key or i.nested_key[0]).startswith("_") for i in rec.config.update)
    ]
    assert len(config_records) == 1  # e.g. Lightning's per-fit hparams logging would add one per client fit
    assert any(i.key == "federation" for i in config_records[0].config.update)

    # metric definitions: "round" is declared and is the x-axis of eval/* and client/*
    assert any(m.name == "round" for m in metrics)
    globs = {m.glob_name: m.step_metric for m in metrics if m.glob_name}
    assert globs.get("eval/*") == "round" and globs.get("client/*") == "round"
    # ... unambiguously: Lightning's own "*" glob (x-axis trainer/global_step) must not compete for these keys
    logged = {k for row in history for k in row if "/" in k and k.split("/")[0] in ROUND_PREFIXES}
    assert logged
    ambiguous = {k: s for k in logged if (s := resolved_step_metrics(k, metrics)) != {"round"}}
    assert not ambiguous, dict(list(ambiguous.items())[:5])
    assert not any("trainer/global_step" in row for row in history)  # W&B inserts it for keys on Lightning's axis


def test_wandb_resume_continues_the_same_run_id(tmp_path):
    run(tmp_path, "--federation.rounds=3", "--federation.checkpoint_every=1")
    first = wandb_files(tmp_path / "r")
    assert len(first) == 1
    first_id = run_id(first[0])
    assert logged_rounds(first[0]) == [1, 2, 3]

    run(tmp_path, "--federation.resume=last", "--federation.rounds=4")
    files = wandb_files(tmp_path / "r")
    assert {run_id(f) for f in files} == {first_id}, files
    # the second W&B run holds round 4 only: it continued after round 3's checkpoint, nothing was replayed
    (resumed,) = [f for f in files if 4 in logged_rounds(f)]
    assert resumed != first[0] and logged_rounds(resumed) == [4]
    assert [int(r["round"]) for r in read_csv(tmp_path / "r" / "rounds.csv")] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------------ alternatives


def test_csv_logger_logs_rounds_as_steps(tmp_path):
    save_dir = tmp_path / "csv"
    run(tmp_path, "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={save_dir}")
    (path,) = save_dir.glob("**/metrics.csv")
    rows = [r for r in read_csv(path) if r.get("eval/global/acc")]
    assert [int(r["step"]) for r in rows] == [1, 2]
    rounds_csv = read_csv(tmp_path / "r" / "rounds.csv")
    assert [float(r["eval/global/acc"]) for r in rows] == [float(r["eval/global/acc"]) for r in rounds_csv]
    assert not list((tmp_path / "r").glob("wandb"))  # no W&B files when another logger is chosen


def test_tensorboard_logger_writes_round_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save_dir = tmp_path / "tb"
    run(
        tmp_path,
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
        f"--trainer.logger.save_dir={save_dir}",
    )
    events = list(save_dir.glob("**/events.out.tfevents.*"))
    assert events
    scalars = []
    for path in {e.parent for e in events}:
        acc = EventAccumulator(str(path))
        acc.Reload()
        if "eval/global/acc" in acc.Tags()["scalars"]:
            scalars += acc.Scalars("eval/global/acc")
    assert [s.step for s in scalars] == [1, 2]
    rounds_csv = read_csv(tmp_path / "r" / "rounds.csv")
    expected = [float(r["eval/global/acc"]) for r in rounds_csv]
    assert [s.value for s in scalars] == pytest.approx(expected, abs=1e-6)  # stored as float32


# ------------------------------------------------------------------------------------------------ many clients


def test_many_clients_log_a_table_and_histograms_instead_of_per_client_keys(tmp_path, monkeypatch):
    from fl_lightning.outputs import records

    monkeypatch.setattr(records, "PER_CLIENT_KEYS_MAX", 2)  # the tiny run's 5 clients count as many
    run(tmp_path, "--federation.rounds=3", "--federation.eval_every=2")
    history, _, metrics = history_and_config(wandb_files(tmp_path / "r")[0])
    by_round = {int(float(row["round"])): row for row in history if "round" in row}
    assert sorted(by_round) == [1, 2, 3]
    kind = lambda row, key: json.loads(row.get(f"{key}/_type", "null"))  # noqa: E731 - W&B nests media fields
    for r, row in by_round.items():
        assert not any(k.startswith("client/") for k in row), r  # no per-client keys
        assert kind(row, "clients/train/loss") == "histogram", sorted(row)
        assert "eval/global/acc" in row or r == 1
        assert kind(row, "clients/table") == ("table-file" if r != 1 else None), r  # the table on evaluation rounds
        assert kind(row, "clients/eval/global/acc") == ("histogram" if r != 1 else None), r
    assert resolved_step_metrics("clients/table", metrics) == {"round"}
    assert resolved_step_metrics("clients/eval/global/acc", metrics) == {"round"}
    # the table holds one row per client with what metrics.csv holds
    (files_dir,) = (tmp_path / "r").glob("wandb/offline-run-*/files")
    table = json.loads((files_dir / json.loads(by_round[2]["clients/table/path"])).read_text())
    rows = {(int(r["round"]), r["client"]): r for r in read_csv(tmp_path / "r" / "metrics.csv")}
    acc = table["columns"].index("eval/global/acc")
    logged = {row[0]: row[acc] for row in table["data"]}
    assert len(logged) == 5 and logged == {c: float(row["global/acc"]) for (r, c), row in rows.items() if r == 2}


def test_offline_wandb_opens_in_the_background_and_its_error_reaches_the_first_log(tmp_path, monkeypatch):
    """Offline: start() returns before W&B is open; a failure to open it is raised where the run is first needed."""
    from fl_lightning.outputs import tracking

    opened = []

    def slow_failure(logger, run_dir, run_id):
        opened.append(run_dir)
        raise RuntimeError("the W&B service did not start")

    monkeypatch.setattr(tracking, "_open_wandb", slow_failure)
    tracker = tracking.RoundTracker([tracking.WandbArgs({"offline": True, "save_dir": str(tmp_path)})])
    tracker.start(tmp_path, {"a": 1})  # does not raise: opening happens in its own thread
    with pytest.raises(RuntimeError, match="did not start"):
        tracker.log_round(1, {"eval/global/acc": 0.5})
    assert opened == [tmp_path]

    failed = tracking.RoundTracker([tracking.WandbArgs({"offline": True, "save_dir": str(tmp_path)})])
    failed.start(tmp_path, {"a": 1})
    failed.finish("failed")  # the run's own error is being raised: the logger's does not replace it


def test_online_wandb_opens_before_the_first_round(tmp_path, monkeypatch):
    """Online: a login or network error stops the run in start(), before any training."""
    monkeypatch.delenv("WANDB_MODE")  # online for the tracker (opening it is replaced: nothing reaches the network)
    from fl_lightning.outputs import tracking

    def failure(logger, run_dir, run_id):
        raise RuntimeError("wandb.errors.CommError: not logged in")

    monkeypatch.setattr(tracking, "_open_wandb", failure)
    tracker = tracking.RoundTracker([tracking.WandbArgs({"offline": False, "save_dir": str(tmp_path)})])
    with pytest.raises(RuntimeError, match="not logged in"):
        tracker.start(tmp_path, {"a": 1})


def test_client_fits_run_without_the_loggers(tmp_path, monkeypatch):
    """The shared Trainer's loggers move to the round tracker: Lightning never opens W&B at a client fit's setup."""
    from lightning.pytorch.loggers import WandbLogger

    from_lightning = []
    original = WandbLogger.experiment.fget

    def watched(self):
        from_lightning.extend(f.name for f in traceback.extract_stack() if f.filename.endswith("trainer/call.py"))
        return original(self)

    monkeypatch.setattr(WandbLogger, "experiment", property(watched))
    run(tmp_path)
    history, _, _ = history_and_config(wandb_files(tmp_path / "r")[0])
    assert [json.loads(row["round"]) for row in history] == [1, 2]
    assert from_lightning == []  # with the logger on the Trainer: "_call_setup_hook" at every client fit
