"""Clients sharded over ranks (torch.distributed) against one process, on the same FedAvg workload.

Workload: embedded digits at 16 px, ``--clients`` clients (IID, site styles), the config's CNN (width 32),
batch 32, 1 local epoch, every client every round, evaluation only at the end. Each setting runs
``train.py`` in a fresh process (so start-up is included in the whole-process time):

- ``1 process × 1 thread``  (OMP_NUM_THREADS=1)
- ``1 process × T threads`` (OMP_NUM_THREADS=T, T = the ranks' total)
- ``N ranks × 1 thread``    (``--federation.workers=N``, OMP_NUM_THREADS=1 in each rank)

With ``--device cuda`` the settings are instead ``N ranks on one GPU`` for each N of ``--ranks`` (``1 2 4 8``: the
ranks share the GPU through ``--federation.workers_per_device=N``), and the states are compared without the
claim that they must match (cuDNN's kernels need not sum alike).

It prints the whole-process wall time, the mean round time over rounds 2… (``time/round`` in rounds.csv,
rank 0's view: it includes waiting for the other ranks) and the speed-ups against one process with one
thread; the final states of all settings are compared (they must be bit-identical). Settings are
interleaved over ``--repeats`` and the medians reported.

    python benchmarks/distributed.py [--clients 20] [--rounds 6] [--ranks 2] [--repeats 3]
    python benchmarks/distributed.py --device cuda --clients 100 --rounds 5 --ranks 1 2 4 8 --repeats 1
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.anchors.runs import describe  # noqa: E402


def run(out: Path, name: str, args: argparse.Namespace, threads: int, workers: int) -> tuple[float, float, str]:
    cmd = [
        sys.executable, "train.py", "--config", "configs/fedavg_digits.yaml", f"--data.num_clients={args.clients}",
        f"--federation.rounds={args.rounds}", "--federation.eval_every=0", "--federation.quiet=true",
        "--federation.plots=false", "--trainer.logger=false", f"--federation.output_dir={out}",
        f"--federation.run_name={name}", f"--federation.workers={workers}",
    ]  # fmt: skip
    if args.device == "cuda":  # every rank on the one GPU
        cmd += ["--trainer.accelerator=gpu", f"--federation.workers_per_device={workers}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = list(csv.DictReader((out / name / "rounds.csv").open()))
    per_round = statistics.mean(float(r["time/round"]) for r in rows[1:])
    return wall, per_round, describe(out / name)["sha256"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="on CPU one number; on CUDA several")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cuda":
        settings = {f"{n} ranks on one GPU": (1, n) for n in args.ranks}
    else:
        n = args.ranks[-1]
        settings = {"1 process x 1 thread": (1, 1), f"1 process x {n} threads": (n, 1), f"{n} ranks x 1 thread": (1, n)}
    results: dict[str, list[tuple[float, float, str]]] = {k: [] for k in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for i, (label, (threads, workers)) in enumerate(settings.items()):
                results[label].append(run(Path(tmp), f"r{rep}-{i}", args, threads, workers))
    base = results[next(iter(settings))]  # the first setting: one process with one thread, or one rank on the GPU
    base_wall, base_round = statistics.median(r[0] for r in base), statistics.median(r[1] for r in base)
    print(f"{args.clients} digit clients, {args.rounds} rounds, median of {args.repeats} interleaved runs")
    print(f"| setting | whole process (s) | round, rounds 2+ (s) | round speed-up vs {next(iter(settings))} |")
    print("|---|---|---|---|")
    for label, rs in results.items():
        wall, per_round = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        print(f"| {label} | {wall:.1f} ({base_wall / wall:.2f}×) | {per_round:.2f} | {base_round / per_round:.2f}× |")
    if args.device == "cuda":
        states = {r[2] for rs in results.values() for r in rs}
        print(f"final states identical across the rank counts: {len(states) == 1}")
        return
    # one thread per process on both sides: the same arithmetic, so the same bits (two threads may sum differently)
    one_thread = {r[2] for label in ("1 process x 1 thread", f"{n} ranks x 1 thread") for r in results[label]}
    print(f"final states bit-identical, 1 process x 1 thread vs {n} ranks x 1 thread: {len(one_thread) == 1}")


if __name__ == "__main__":
    main()
