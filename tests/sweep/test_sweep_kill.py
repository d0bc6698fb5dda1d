"""The acceptance test: a sweep of 6 trials on 2 workers, SIGKILLed mid-trial and restarted with the same command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from fl_lightning.cli import main as train
from fl_lightning.tools.sweep.claims import trial_values
from fl_lightning.tools.sweep.study import Plan, open_storage
from fl_lightning.tools.sweep.trial_run import run_args, trial_dir
from tests.anchors.runs import describe
from tests.sweep.tiny import FEDPROX, SPACE, TINY, write_space

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 600  # seconds a phase may take before the test gives up (and stops what it started)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """The sweep in its own process group (its workers join it), output to ``log``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with log.open("ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL the sweep's whole process group (the sweep and its workers), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def interrupted(trials: Path) -> list[Path]:
    """Trial run directories with a round checkpoint and no summary: written part way, not finished."""
    return [d for d in sorted(trials.glob("trial-*")) if list(d.glob("checkpoints/round-*.ckpt"))
            and not (d / "summary.json").exists()]  # fmt: skip


def test_a_killed_sweep_continues_its_running_trials_from_their_checkpoints(tmp_path):
    gate, out, log = tmp_path / "gate", tmp_path / "sweep", tmp_path / "sweep.log"
    held = json.dumps({"class_path": "tests.sweep.gate.Gate", "init_args": {"path": str(gate)}})
    cmd = [sys.executable, "-m", "fl_lightning.sweep", "--config", FEDPROX,
           "--space", str(write_space(tmp_path / "space.yaml", SPACE)), "--trials", "6", "--workers", "2",
           "--objective", "val/acc_mean", "--seeds", "0", "--out", str(out), "--", *TINY, "--federation.rounds=3",
           f"--trainer.callbacks+={held}"]  # fmt: skip
    first = start(cmd, log)
    try:
        # every trial waits at the gate after its round-1 checkpoint: the kill finds trials part way
        deadline = time.monotonic() + DEADLINE
        while not interrupted(out / "trials") and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert interrupted(out / "trials"), log.read_text()[-3000:]
    finally:
        stop(first)
    killed = interrupted(out / "trials")
    plan = Plan.read(out / "sweep.json")
    study = optuna.load_study(study_name=plan.study, storage=open_storage(plan.storage))
    running = {t.number for t in study.get_trials() if t.state == TrialState.RUNNING}
    assert {int(d.name.split("-")[1]) for d in killed} <= running

    gate.touch()
    second = start(cmd, log)  # the same command
    try:
        assert second.wait(timeout=DEADLINE) == 0, log.read_text()[-3000:]
    finally:
        stop(second)
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(6)), "a trial was sampled again instead of continued"
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials), [t.state for t in trials]
    assert len({json.dumps(t.params, sort_keys=True) for t in trials}) == 6
    text = log.read_text()
    for t in trials:
        assert f"trial {t.number}: {t.state.name.lower()}" in text
    # each interrupted trial went on from its checkpoint and ends as an uninterrupted run of its parameters
    for run in killed:
        number = int(run.name.split("-")[1])
        assert json.loads((run / "resume_changes.json").read_text())[0]["after_round"] >= 1
        values = trial_values(trials[number], plan.space.fixed)
        reference = train(run_args(plan, values, tmp_path / "reference", run.name, None))
        assert describe(run)["sha256"] == describe(tmp_path / "reference" / run.name)["sha256"]
        summary = json.loads((trial_dir(plan, number) / "summary.json").read_text())
        assert summary["summary"] == reference["summary"] and summary["clients"] == reference["clients"]
        if trials[number].state == TrialState.COMPLETE:
            assert trials[number].value == reference["selection"]["value"]
