"""Start-up and exit: ``python train.py --help``, a run's launch to round 1, and its last line to the process's end.

The run is ``configs/fedavg_digits.yaml`` with the default logger (W&B offline) and plots, one round. The exit is
timed through ``train.py`` itself, from its final line (``run directory: …``) reaching the pipe to the end of the
process (W&B's teardown, the exit handlers and whatever the interpreter does before the process is gone). The floors
``python -c "import torch"`` and ``python -c "import lightning"`` are timed alongside. Each measurement is a fresh
process; ``--repeats`` alternates them and prints the medians. ``--repo`` measures another
checkout (e.g. a ``git worktree`` of an older commit) with this interpreter, for before/after numbers in one run.

    python benchmarks/startup.py [--repeats 3] [--repo PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Imports timed alone in the same run: what any Lightning program pays before our code starts.
FLOORS = ("torch", "lightning")

# Runs in the child: time of the first round's start (wall clock) into the file named by the first argument.
PROBE = """
import sys, time
from pathlib import Path
from fl_lightning.server import federation
out = sys.argv.pop(1)
original = federation.Federation.run_round
def probed(self, r):
    if not Path(out).exists():
        Path(out).write_text(str(time.time()))
    return original(self, r)
federation.Federation.run_round = probed
from fl_lightning.cli import main
main()
"""


def help_seconds(repo: Path, env: dict[str, str]) -> float:
    """Wall time of ``python train.py --help``."""
    t0 = time.time()
    subprocess.run([sys.executable, "train.py", "--help"], cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.time() - t0


def startup_seconds(repo: Path, env: dict[str, str], out: Path) -> float:
    """Process launch to the start of round 1 of a one-round FedAvg run on the digits (W&B offline)."""
    stamp = out / f"stamp-{time.time_ns()}"
    args = [
        "--config", "configs/fedavg_digits.yaml", "--federation.rounds=1", f"--federation.output_dir={out}",
        "--federation.progress=false", "--federation.quiet=true",
    ]  # fmt: skip
    t0 = time.time()
    subprocess.run([sys.executable, "-c", PROBE, str(stamp), *args], cwd=repo, env=env, check=True)
    return float(stamp.read_text()) - t0


def exit_seconds(repo: Path, env: dict[str, str], out: Path) -> float:
    """From the last line of a one-round run through ``train.py`` to the end of its process."""
    args = [
        "--config", "configs/fedavg_digits.yaml", "--federation.rounds=1", f"--federation.output_dir={out}",
        "--federation.progress=false",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    last_line = [0.0]

    def read() -> None:  # a thread: W&B's service may hold the pipe open after the process ended
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(b"run directory:"):
                last_line[0] = time.time()

    threading.Thread(target=read, daemon=True).start()
    if proc.wait() != 0:
        raise RuntimeError(f"train.py exited with {proc.returncode}")
    return time.time() - last_line[0]


def import_seconds(module: str, env: dict[str, str]) -> float:
    """Wall time of ``python -c "import <module>"``: the floor under ``--help`` and start-up that is not ours."""
    t0 = time.time()
    subprocess.run([sys.executable, "-c", f"import {module}"], env=env, check=True)
    return time.time() - t0


def main() -> None:
    """Measure and print medians (JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    repo = args.repo.resolve()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo), "WANDB_MODE": "offline"}
    helps, starts, exits, floors = [], [], [], {m: [] for m in FLOORS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            helps.append(help_seconds(repo, env))
            starts.append(startup_seconds(repo, env, Path(tmp)))
            exits.append(exit_seconds(repo, env, Path(tmp)))
            for module in FLOORS:
                floors[module].append(import_seconds(module, env))
    print(
        json.dumps(
            {
                "repo": str(repo),
                "help_s": statistics.median(helps),
                "startup_to_round1_s": statistics.median(starts),
                "last_line_to_exit_s": statistics.median(exits),
                **{f"import_{m}_s": statistics.median(v) for m, v in floors.items()},
                "help_all": helps,
                "startup_all": starts,
                "exit_all": exits,
            }
        )
    )


if __name__ == "__main__":
    main()
