"""train.py's early start of the other ranks: reading ``workers`` before parsing, and watching the started ranks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fl_lightning.engines.distributed import RankError
from fl_lightning.startup import early_ranks
from fl_lightning.startup.early_ranks import RankGroup, peek_workers

REPO = Path(__file__).resolve().parents[2]


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_workers_come_from_overrides_and_config_files_with_the_last_one_winning(tmp_path):
    two = write(tmp_path / "two.yaml", "federation:\n  workers: 2\n  rounds: 3\n")
    silent = write(tmp_path / "silent.yaml", "federation:\n  rounds: 3\ndata:\n  alpha: 0.5\n")
    assert peek_workers([]) == 1
    assert peek_workers(["--config", silent]) == 1
    assert peek_workers(["--config", two]) == 2
    assert peek_workers([f"--config={two}", "--config", silent]) == 2  # a file that does not set it keeps it
    assert peek_workers(["--config", two, "--federation.workers=1"]) == 1
    assert peek_workers(["--federation.workers", "3", "--config", two]) == 2
    assert peek_workers(["--federation.workers=4", "--trainer.max_epochs=1"]) == 4


@pytest.mark.parametrize(
    "argv",
    [
        ["--federation", '{"workers": 2}'],  # the whole section: only the parser can tell
        ["--federation=fed.yaml"],
        ["--federation.workers=2", "--help"],
        ["--print_config", "--federation.workers=2"],
        ["--federation.workers=two"],  # the parser will name the key
        ["--federation.workers"],
        ["--config", "missing.yaml"],  # the parser will name the file
    ],
)
def test_what_cannot_be_told_before_parsing_is_left_to_the_parser(argv):
    assert peek_workers(argv) is None


@pytest.mark.parametrize("text", ["federation: fed.yaml\n", "federation:\n  workers: true\n", "[1, 2]\n", ": :\n"])
def test_config_files_that_do_not_say_a_number_are_left_to_the_parser(tmp_path, text):
    assert peek_workers(["--config", write(tmp_path / "c.yaml", text)]) is None


def test_nothing_starts_under_torchrun_or_for_one_worker(monkeypatch):
    monkeypatch.setattr(early_ranks, "_started", None)
    monkeypatch.setenv("RANK", "1")
    assert early_ranks.start(["--federation.workers=2"]) is None
    monkeypatch.delenv("RANK")
    assert early_ranks.start(["--federation.workers=1"]) is None
    assert early_ranks.started() is None


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def wait_for_failure(group: RankGroup) -> str:
    deadline = time.monotonic() + 30
    while group.failure is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return group.failure


def test_a_rank_that_fails_is_named_and_the_others_are_stopped(monkeypatch):
    monkeypatch.setattr(early_ranks, "GRACE_S", 60.0)  # this test closes the group itself, well within it
    sleeper = child("import time; time.sleep(60)")
    group = RankGroup({1: child("raise SystemExit(3)"), 2: sleeper})
    try:
        assert wait_for_failure(group) == "rank 1 exited with code 3"
        assert sleeper.wait(30) != 0  # stopped by the watcher
    finally:
        group.close(ok=False)
    assert group.world_size == 3


def test_closing_after_a_good_run_waits_for_the_ranks_and_names_one_that_failed(monkeypatch):
    monkeypatch.setattr(early_ranks, "GRACE_S", 60.0)
    RankGroup({1: child("pass")}).close(ok=True)
    group = RankGroup({1: child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")})
    time.sleep(0.5)
    with pytest.raises(RankError, match=r"rank 1 died \(SIGKILL\)"):
        group.close(ok=True)


def test_a_rank_that_does_not_exit_after_the_run_is_stopped_and_named(monkeypatch):
    monkeypatch.setattr(early_ranks, "EXIT_WAIT_S", 0.2)
    proc = child("import time; time.sleep(60)")
    with pytest.raises(RankError, match="rank 1 did not exit within 0 s"):
        RankGroup({1: proc}).close(ok=True)
    assert proc.returncode is not None


def test_a_parsed_config_that_disagrees_with_the_started_ranks_is_refused():
    group = RankGroup({})
    group.check_workers(1)
    with pytest.raises(ValueError, match="federation.workers: .* 1 ranks .* says 2; .*--federation.workers=2"):
        group.check_workers(2)


def test_rank_zero_blocked_when_another_rank_fails_is_ended_saying_why():
    # Rank 0 stuck in a call that does not return (joining a group a dead rank never joins): the watcher ends it.
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from fl_lightning.startup import early_ranks
        early_ranks.GRACE_S = 0.5
        early_ranks.RankGroup({1: subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])})
        time.sleep(60)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1
    assert "rank 1 exited with code 5; stopping rank 0" in proc.stderr


def test_reading_the_command_line_imports_neither_torch_nor_lightning():
    # The point of starting the ranks early: nothing heavy is loaded before they start.
    code = "import sys, fl_lightning.startup.early_ranks; print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


def test_a_rank_that_failed_by_the_end_is_named_and_the_others_are_not_waited_for(monkeypatch):
    monkeypatch.setattr(RankGroup, "_watch", lambda self, rank, proc: None)  # closing alone, no watcher
    failed, sleeper = child("raise SystemExit(3)"), child("import time; time.sleep(60)")
    failed.wait(30)
    group = RankGroup({1: failed, 2: sleeper})
    started = time.monotonic()
    with pytest.raises(RankError, match="rank 1 exited with code 3"):
        group.close(ok=True)
    assert sleeper.wait(30) != 0 and time.monotonic() - started < 30
