"""``quick_exit``: a finished process ends after its exit handlers, without the interpreter's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_configs import TINY
from tests.wandb_offline import history_and_config, read_records

REPO = Path(__file__).resolve().parents[2]

# A process that arms the handler, then registers what a run leaves for the end: a logging handler that writes
# only when it is closed, a later exit handler, an object freed only by the interpreter's teardown, a file left
# open and stdout that are not flushed yet. argv: output folder, then "finish <status>", "raise" or "return".
SCRIPT = """
import atexit, logging, logging.handlers, os, sys
from fl_lightning.startup import quick_exit
out, how = sys.argv[1], sys.argv[2:]
print("armed" if quick_exit.arm() else "not armed", file=sys.stderr)

def mark(name, open=open, join=os.path.join):  # bound now: the teardown clears the names late in its course
    with open(join(out, name), "w") as f:
        f.write("ran")

log = logging.getLogger("probe")
log.addHandler(logging.handlers.MemoryHandler(100, target=logging.FileHandler(os.path.join(out, "log.txt"))))
log.warning("written when the handler is closed")
atexit.register(mark, "later_handler")

class FreedAtTeardown:
    def __del__(self, mark=mark):
        mark("teardown")

kept = FreedAtTeardown()
left_open = open(os.path.join(out, "left_open.txt"), "w")  # never closed: written out when the process ends
left_open.write("buffered in a file")
print("buffered output", end="")
if how[0] == "raise":
    raise RuntimeError("the run failed")
if how[0] == "finish":
    quick_exit.finished(int(how[1]))
"""


def run_script(tmp_path: Path, *how: str, before: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", before + SCRIPT, str(tmp_path), *how],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("status", [0, 3])
def test_a_finished_process_runs_the_exit_handlers_then_ends_without_teardown(tmp_path, status):
    done = run_script(tmp_path, "finish", str(status))
    assert done.returncode == status, done.stderr
    assert "armed" in done.stderr.splitlines()
    assert done.stdout == "buffered output"  # flushed before the process ended
    assert (tmp_path / "left_open.txt").read_text() == "buffered in a file"
    assert (tmp_path / "later_handler").is_file()  # registered after arm(): run before it
    assert "written when the handler is closed" in (tmp_path / "log.txt").read_text()  # logging.shutdown ran
    assert not (tmp_path / "teardown").exists()  # the interpreter's teardown was skipped


@pytest.mark.parametrize("how", ["raise", "return"])
def test_a_process_that_did_not_finish_exits_as_usual(tmp_path, how):
    done = run_script(tmp_path, how)
    assert done.returncode == (1 if how == "raise" else 0)
    assert ("RuntimeError: the run failed" in done.stderr) is (how == "raise")
    assert done.stdout == "buffered output"
    assert (tmp_path / "left_open.txt").read_text() == "buffered in a file"
    assert (tmp_path / "later_handler").is_file()
    assert "written when the handler is closed" in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "teardown").is_file()  # the teardown freed the object


def test_it_is_not_armed_when_another_exit_handler_was_registered_before(tmp_path):
    """A handler registered earlier (a tool measuring the process at exit) would be skipped: exit as usual."""
    before = "import atexit; atexit.register(lambda: open(sys.argv[1] + '/earlier_handler', 'w').close())\n"
    done = run_script(tmp_path, "finish", "0", before="import sys\n" + before)
    assert done.returncode == 0, done.stderr
    assert "not armed" in done.stderr.splitlines()
    assert (tmp_path / "earlier_handler").is_file()
    assert (tmp_path / "teardown").is_file()


def test_train_py_arms_it_first_and_a_finished_run_keeps_every_output(tmp_path):
    """train.py through its own exit: the run directory and W&B's offline run are complete (its exit record)."""
    probe = "from fl_lightning.startup import quick_exit; print(quick_exit.arm())"
    armed = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert armed.stdout.split() == ["True"]  # the package's import registers no handler that it would skip

    tiny = [a for a in TINY if not a.startswith("--trainer.logger")]  # the default logger: W&B offline
    args = ["--config", "configs/fedavg_digits.yaml", *tiny, f"--federation.output_dir={tmp_path}"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    done = subprocess.run(
        [sys.executable, "train.py", *args, "--federation.run_name=r"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "r"
    assert (run_dir / "summary.json").is_file() and (run_dir / "curves.png").is_file()
    assert f"run directory: {run_dir}" in done.stdout  # the final table's last line reached the pipe
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history, _, _ = history_and_config(wandb_file)
    assert sorted(int(float(row["round"])) for row in history if "round" in row) == [1, 2]
    kinds = [record.WhichOneof("record_type") for record in read_records(wandb_file)]
    assert "exit" in kinds  # W&B finished the run before the process ended
