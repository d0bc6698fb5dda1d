"""Which trial a worker takes: orphans (their worker gone) are continued, new trials only up to the target."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from fl_lightning.tools.sweep.claims import counts, decide, orphans
from fl_lightning.tools.sweep.owners import GRACE, PREFIX, Owner, is_alive, process_start, this_process

NOW = 1_000_000.0
HERE = this_process()


def gone_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def trial(number: int, state: TrialState, owner: Owner | None = None, beat: float | None = None, params=True):
    attrs = {} if owner is None else owner.attrs()
    if beat is not None:
        attrs[f"{PREFIX}heartbeat"] = beat
    t = create_trial(
        state=state,
        value=0.5 if state == TrialState.COMPLETE else None,
        params={"lr": 0.1} if params else {},
        distributions={"lr": FloatDistribution(0.01, 1.0)} if params else {},
        user_attrs=attrs,
    )
    t.number = number
    t.datetime_start = datetime.datetime.fromtimestamp(NOW - 10)
    return t


def dead_here() -> Owner:
    return Owner(HERE.host, HERE.boot, gone_pid(), "123")


def test_this_process_is_alive_and_a_gone_or_reused_pid_is_not():
    assert is_alive(HERE, {}, NOW, HERE)
    assert not is_alive(dead_here(), {}, NOW, HERE)
    reused = Owner(HERE.host, HERE.boot, os.getpid(), "not-my-start-time")  # the pid now names another process
    assert HERE.started and not is_alive(reused, {}, NOW, HERE)
    rebooted = Owner(HERE.host, "another-boot", os.getpid(), HERE.started)
    assert not is_alive(rebooted, {}, NOW, HERE)
    assert process_start(gone_pid()) is None


def test_another_machines_trial_lives_as_long_as_its_heartbeat():
    there = Owner("elsewhere", "b", 1, "1")
    assert is_alive(there, {f"{PREFIX}heartbeat": NOW - GRACE / 2}, NOW, HERE)
    assert not is_alive(there, {f"{PREFIX}heartbeat": NOW - GRACE - 1}, NOW, HERE)
    assert not is_alive(there, {}, NOW, HERE)


def test_an_orphan_is_continued_before_any_new_trial():
    trials = [
        trial(0, TrialState.COMPLETE),
        trial(1, TrialState.RUNNING, HERE),
        trial(2, TrialState.RUNNING, dead_here()),
    ]
    decision = decide(trials, target=3, max_failures=3, now=NOW, here=HERE)
    assert decision.action == "continue" and decision.trial.number == 2


def test_orphans_are_taken_oldest_first_and_a_trial_without_owner_waits_out_the_grace():
    young = trial(5, TrialState.RUNNING)  # asked for 10 s ago; its worker may be writing its owner now
    trials = [trial(3, TrialState.RUNNING, dead_here()), trial(1, TrialState.RUNNING, dead_here()), young]
    assert [t.number for t in orphans(trials, NOW, HERE)] == [1, 3]
    assert [t.number for t in orphans(trials, NOW + GRACE, HERE)] == [1, 3, 5]


def test_an_orphan_without_parameters_is_abandoned():
    empty = trial(0, TrialState.RUNNING, dead_here(), params=False)
    assert decide([empty], target=2, max_failures=2, now=NOW, here=HERE).action == "abandon"


@pytest.mark.parametrize(
    ("states", "action"),
    [
        ([], "new"),
        ([TrialState.COMPLETE, TrialState.PRUNED], "new"),
        ([TrialState.COMPLETE, TrialState.PRUNED, TrialState.COMPLETE], "stop"),
        ([TrialState.COMPLETE, TrialState.COMPLETE, TrialState.RUNNING], "stop"),  # the last one is being run
        ([TrialState.COMPLETE, TrialState.FAIL], "new"),  # a failed trial does not count
        ([TrialState.FAIL, TrialState.FAIL, TrialState.FAIL], "stop"),  # as many failures as trials: give up
    ],
)
def test_new_trials_only_up_to_the_target(states, action):
    trials = [trial(i, s, HERE if s == TrialState.RUNNING else None) for i, s in enumerate(states)]
    assert decide(trials, target=3, max_failures=3, now=NOW, here=HERE).action == action


def test_counts():
    trials = [trial(0, TrialState.COMPLETE), trial(1, TrialState.PRUNED), trial(2, TrialState.FAIL),
              trial(3, TrialState.RUNNING, HERE)]  # fmt: skip
    assert counts(trials) == {"done": 2, "running": 1, "failed": 1}
