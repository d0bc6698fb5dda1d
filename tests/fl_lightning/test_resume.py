"""Exact resume after a real process kill, atomic checkpoints, and failures that keep the last good checkpoint."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from callbacks import FederatedCallback
from fl_lightning.cli import main
from fl_lightning.outputs.checkpoint import checkpoint_path, find_last_checkpoint, load_checkpoint, save_checkpoint
from tests.conftest import build_federation

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 8
TIMING_COLUMNS = ("time/", "throughput/")


def run_args(out: Path, name: str, extra: list[str]) -> list[str]:
    """Tiny-data arguments; ``extra`` comes first so that a config file in it cannot undo them."""
    return [
        "--config", str(REPO / "configs/fedavg_digits.yaml"),
        *extra,
        "--trainer.logger=false",
        f"--federation.rounds={ROUNDS}",
        "--federation.local_epochs=3",
        "--federation.clients_per_round=3",
        "--federation.progress=false",
        "--federation.plots=false",
        "--federation.keep_checkpoints=0",
        "--data.max_samples_per_client=60",
        "--data.image_size=8",
        "--model.width=4",
        f"--federation.output_dir={out}",
        f"--federation.run_name={name}",
    ]  # fmt: skip


def kill_after_round(args: list[str], run_dir: Path, round_idx: int, timeout: float = 120.0) -> None:
    """Start a real training process and SIGKILL it once the checkpoint of ``round_idx`` exists."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from fl_lightning.cli import main; main()", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    target = checkpoint_path(run_dir, round_idx)
    deadline = time.monotonic() + timeout
    while not target.exists():
        if proc.poll() is not None:
            raise AssertionError(f"training process ended early: {proc.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, "no checkpoint appeared in time"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the process finished before it could be killed"


def rows_without_timings(path: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_COLUMNS)} for row in csv.DictReader(path.open())]


def assert_same_final_state(a: Path, b: Path) -> None:
    ca, cb = load_checkpoint(checkpoint_path(a, ROUNDS)), load_checkpoint(checkpoint_path(b, ROUNDS))
    for ga, gb in zip(ca["groups"], cb["groups"], strict=True):
        assert ga["state"].keys() == gb["state"].keys()
        for key in ga["state"]:
            assert torch.equal(ga["state"][key], gb["state"][key]), key
    for store in ("private", "personal"):
        pa, pb = ca["runtime"].get(store, {}), cb["runtime"].get(store, {})  # {client: {group: state}}
        assert pa.keys() == pb.keys()
        for client in pa:
            for group, state in pa[client].items():
                for key, value in state.items():
                    assert torch.equal(value, pb[client][group][key]), (store, client, key)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [  # FedBN + FedProx with momentum kept across rounds: private layers, optimiser and callback state
            "--config", str(REPO / "configs/fedbn_digits.yaml"),
            "--trainer.callbacks+=callbacks.FedProx", "--trainer.callbacks.mu=0.1",
            "--federation.keep_optimizer_state=true",
        ],
        [  # the same over the serialized transport: the client runtime's state crosses as messages
            "--config", str(REPO / "configs/fedbn_digits.yaml"),
            "--trainer.callbacks+=callbacks.FedProx", "--trainer.callbacks.mu=0.1",
            "--federation.keep_optimizer_state=true", "--federation.transport=serialized",
        ],
        [  # SCAFFOLD training half the clients a round: the checkpoints write only the clients whose c_i changed
            "--config", str(REPO / "configs/scaffold_digits_dirichlet.yaml"), "--federation.client_fraction=0.5",
        ],
        [  # APFL training two of three clients a round: personal models, α, personal batches and ages resume
            "--config", str(REPO / "configs/apfl_digits_dirichlet.yaml"), "--federation.client_fraction=0.67",
        ],
    ],
    ids=["fedavg", "fedbn+fedprox", "fedbn+fedprox-serialized", "scaffold-sampled", "apfl-sampled"],
)  # fmt: skip
def test_resume_after_a_kill_is_exact(tmp_path, extra):
    full = main(run_args(tmp_path, "full", extra))
    kill_after_round(run_args(tmp_path, "killed", extra), tmp_path / "killed", 3)
    resumed = main([*run_args(tmp_path, "killed", extra), "--federation.resume=last"])

    assert_same_final_state(tmp_path / "full", tmp_path / "killed")
    strip = lambda s: {k: v for k, v in s.items() if k != "run_dir"}  # noqa: E731
    assert strip(resumed) == strip(full)
    on_disk = [json.loads((tmp_path / n / "summary.json").read_text()) for n in ("full", "killed")]
    assert strip(on_disk[0]) == strip(on_disk[1])
    assert (tmp_path / "full/metrics.csv").read_text() == (tmp_path / "killed/metrics.csv").read_text()
    assert rows_without_timings(tmp_path / "full/rounds.csv") == rows_without_timings(tmp_path / "killed/rounds.csv")
    if extra and "fedbn" in extra[1]:
        assert resumed["methods"] == ["FedBN", "FedProx"]


def test_a_truncated_checkpoint_is_never_last(tmp_path):
    fed = build_federation(tmp_path, rounds=3, keep_checkpoints=0, run_name="r")
    fed.run()
    run_dir = tmp_path / "r"
    newest = checkpoint_path(run_dir, 3)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # torn write of round 3
    (run_dir / "checkpoints" / ".round-00004.ckpt.x1y2.tmp").write_bytes(b"half a checkpoint")
    with pytest.warns(UserWarning, match="round-00003.ckpt is unreadable"):
        path, state = find_last_checkpoint(run_dir)
    assert path == checkpoint_path(run_dir, 2) and state["round"] == 2

    with pytest.warns(UserWarning, match="unreadable"):
        again = build_federation(tmp_path, rounds=3, keep_checkpoints=0, run_name="r", resume="last")
        again.run()
    for key, value in fed.groups[0].state.items():
        assert torch.equal(value, again.groups[0].state[key]), key


class Arbitrary:
    """Any class: unpickling it would run arbitrary code paths, so weights_only loading must refuse it."""


def test_checkpoints_are_loaded_weights_only(tmp_path):
    path = tmp_path / "evil.ckpt"
    save_checkpoint(path, {"round": 1, "payload": Arbitrary()})
    with pytest.raises(RuntimeError, match="unreadable"):
        load_checkpoint(path)


class FailFromRound(FederatedCallback):
    def __init__(self, round_idx):
        self.round_idx = round_idx
        self.current = 0

    def on_round_start(self, federation, round_idx, selected):
        self.current = round_idx

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.current >= self.round_idx:
            raise RuntimeError("simulated client crash")


def test_all_clients_failing_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    fed = build_federation(tmp_path, [FailFromRound(2)], rounds=4, keep_checkpoints=0, run_name="r")
    with pytest.warns(UserWarning, match="simulated client crash"), pytest.raises(RuntimeError, match="every selected"):
        fed.run()
    run_dir = tmp_path / "r"
    path, state = find_last_checkpoint(run_dir)
    assert path == checkpoint_path(run_dir, 2) and state["round"] == 2
    assert not checkpoint_path(run_dir, 3).exists()


def test_resume_errors_name_what_is_missing_or_different(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        build_federation(tmp_path, run_name="nothing-here", resume="last").run()
    build_federation(tmp_path, rounds=1, run_name="r").run()
    with pytest.raises(ValueError, match="callbacks"):
        build_federation(tmp_path, [FailFromRound(9)], rounds=2, run_name="r", resume="last").run()
