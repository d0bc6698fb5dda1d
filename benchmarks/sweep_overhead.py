"""What a sweep adds to the runs it makes: its wall time against its trials' run times plus one start per worker.

    python benchmarks/sweep_overhead.py [--trials 8] [--workers 1] [--rounds 3] [-- extra train.py overrides]

Runs ``python -m fl_lightning.sweep`` on the digits (FedAvg, the learning rate on FLamby's grid, no re-runs of the
best configuration) as a whole process, and prints

    ratio = sweep wall time / (sum of the trials' run times + workers x one worker process start)

where a trial's run time is the time its worker spent in ``fl_lightning.cli.main`` (``run_seconds`` in
``sweep_results.csv``) and a worker's start is measured as the median time of ``python -c "import
fl_lightning.cli"`` (what a worker does before its first trial). Everything else the sweep does is in the
numerator: its own start and the checks of its input (Lightning imported, the config parsed and instantiated),
the study's database, asking and telling, the progress loop, ``sweep_results.csv`` and the plots. The issue's
target is 1.05 or less. With several workers the trials overlap, so the ratio is meaningful with ``--workers 1``.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPACE = """data.init_args.val_fraction: 0.2
model.init_args.lr: {type: flamby_grid, low_k: -5, high_k: -2}
model.init_args.momentum: {type: uniform, low: 0.0, high: 0.9}
"""


def timed(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds one command takes as a whole process (it must succeed)."""
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    own, extra = (sys.argv[1:], [])
    if "--" in own:
        cut = own.index("--")
        own, extra = own[:cut], own[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--starts", type=int, default=3, help="worker starts timed (their median is used)")
    args = parser.parse_args(own)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = statistics.median(timed([sys.executable, "-c", "import fl_lightning.cli"], env) for _ in range(args.starts))
    with tempfile.TemporaryDirectory() as tmp:
        space = Path(tmp) / "space.yaml"
        space.write_text(SPACE)
        out = Path(tmp) / "sweep"
        cmd = [sys.executable, "-m", "fl_lightning.sweep", "--config", "configs/fedavg_digits.yaml",
               "--space", str(space), "--trials", str(args.trials), "--workers", str(args.workers),
               "--objective", "val/acc_mean", "--seeds", "0", "--sampler", "random", "--pruner", "none",
               "--out", str(out), "--", "--trainer.logger=false", f"--federation.rounds={args.rounds}",
               *extra]  # fmt: skip
        wall = timed(cmd, env)
        rows = list(csv.DictReader((out / "sweep_results.csv").open()))
    runs = sum(float(r["run_seconds"]) for r in rows)
    ratio = wall / (runs + args.workers * start)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"trials {len(rows)} ({args.rounds} rounds each), workers {args.workers}")
    print(f"one worker start (median of {args.starts}): {start:.2f} s")
    print(f"sum of the trials' run times: {runs:.2f} s (mean {runs / len(rows):.2f} s)")
    print(f"sweep wall time: {wall:.2f} s")
    print(f"ratio: {ratio:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
