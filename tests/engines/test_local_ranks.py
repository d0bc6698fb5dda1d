"""The one launcher of local ranks: rank 0 is the process that parsed the config; the started ranks are watched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fl_lightning.engines import local_ranks
from fl_lightning.engines.distributed import RankError, environment_rank
from fl_lightning.engines.local_ranks import RankGroup

REPO = Path(__file__).resolve().parents[2]


def test_start_makes_this_process_rank_0_and_close_gives_back_its_environment(monkeypatch):
    monkeypatch.setattr(local_ranks, "RANK_CODE", "import os, sys; sys.exit(0 if os.environ['RANK'] in '12' else 9)")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key in local_ranks.RANK_VARS:
        monkeypatch.delenv(key, raising=False)
    threads = torch.get_num_threads()
    group = local_ranks.start(["--federation.workers=3"], 3)
    try:
        assert group.world_size == 3 and sorted(group.children) == [1, 2]
        assert (
            os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "3" and os.environ["MASTER_ADDR"] == "127.0.0.1"
        )
        assert environment_rank() == (0, 3, 0) and torch.get_num_threads() == 1
    finally:
        group.close(ok=True)  # both ranks exit 0: they saw RANK 1 and 2
    assert not {k for k in local_ranks.RANK_VARS if k in os.environ}
    assert torch.get_num_threads() == threads


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def wait_for_failure(group: RankGroup) -> str:
    deadline = time.monotonic() + 30
    while group.failure is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return group.failure


def test_a_rank_that_fails_is_named_and_the_others_are_stopped(monkeypatch):
    monkeypatch.setattr(local_ranks, "GRACE_S", 60.0)  # this test closes the group itself, well within it
    sleeper = child("import time; time.sleep(60)")
    group = RankGroup({1: child("raise SystemExit(3)"), 2: sleeper})
    try:
        assert wait_for_failure(group) == "rank 1 exited with code 3"
        assert sleeper.wait(30) != 0  # stopped by the watcher
    finally:
        group.close(ok=False)
    assert group.world_size == 3


def test_closing_after_a_good_run_waits_for_the_ranks_and_names_one_that_failed(monkeypatch):
    monkeypatch.setattr(local_ranks, "GRACE_S", 60.0)
    RankGroup({1: child("pass")}).close(ok=True)
    group = RankGroup({1: child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")})
    time.sleep(0.5)
    with pytest.raises(RankError, match=r"rank 1 died \(SIGKILL\)"):
        group.close(ok=True)


def test_a_rank_that_does_not_exit_after_the_run_is_stopped_and_named(monkeypatch):
    monkeypatch.setattr(local_ranks, "EXIT_WAIT_S", 0.2)
    proc = child("import time; time.sleep(60)")
    with pytest.raises(RankError, match="rank 1 did not exit within 0 s"):
        RankGroup({1: proc}).close(ok=True)
    assert proc.returncode is not None


def test_rank_zero_blocked_when_another_rank_fails_is_ended_saying_why():
    # Rank 0 stuck in a call that does not return (joining a group a dead rank never joins): the watcher ends it.
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from fl_lightning.engines import local_ranks
        local_ranks.GRACE_S = 0.5
        local_ranks.RankGroup({1: subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])})
        time.sleep(60)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1
    assert "rank 1 exited with code 5; stopping rank 0" in proc.stderr


def test_a_rank_that_failed_by_the_end_is_named_and_the_others_are_not_waited_for(monkeypatch):
    monkeypatch.setattr(RankGroup, "_watch", lambda self, rank, proc: None)  # closing alone, no watcher
    failed, sleeper = child("raise SystemExit(3)"), child("import time; time.sleep(60)")
    failed.wait(30)
    group = RankGroup({1: failed, 2: sleeper})
    started = time.monotonic()
    with pytest.raises(RankError, match="rank 1 exited with code 3"):
        group.close(ok=True)
    assert sleeper.wait(30) != 0 and time.monotonic() - started < 30
