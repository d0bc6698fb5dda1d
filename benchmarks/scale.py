"""Scale: what a run costs at 10, 100 and 1,000 clients with 10 % of them trained per round.

Each configuration runs ``train.py``'s entry point in a fresh process (so start-up and peak memory are its own) on
:class:`datamodules.many_digits.ManyDigitsFederated` (digits drawn per client with per-client augmentation; about
40 images per client, Dirichlet α = 0.5), SmallCNN (width 32, BatchNorm, SGD lr 0.1 without momentum: SCAFFOLD's
precondition), batch 32, one local epoch, ``client_fraction`` 0.1, ``eval_clients`` 0.1 on intermediate rounds (all
clients after the last), plots on, a round checkpoint every round, no logger. Per configuration it prints:

- start-up: process launch to the start of round 1 (interpreter, imports, CLI, data, partition.png);
- s/round: median over rounds 2…R of ``time/train + time/aggregate`` (``rounds.csv``);
- eval s: median ``time/eval`` of the sampled intermediate rounds, and of the last round (every client);
- peak RSS of the process;
- checkpoint: size and median write time (``state_dict`` + fsync of the CSVs + atomic save).

With ``--ckpt-round 100`` the 1,000-client FedAvg process also measures the checkpoint and the round's records at
round 100 (the run's rows repeated to 100 rounds), as written now (row counts; rows appended) and as before (every
row in every checkpoint; ``metrics.csv`` rewritten whole each round). ``--reference`` adds FedAvg with every one of
100 clients trained per round (the same number trained per round as 10 % of 1,000).

    python benchmarks/scale.py [--clients 10 100 1000] [--methods fedavg fedbn scaffold] [--rounds 5] [--repeats 1]
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
METHODS = {"fedavg": [], "fedbn": ["callbacks.FedBN"], "scaffold": ["callbacks.Scaffold"]}


def config(args: argparse.Namespace, clients: int, method: str, fraction: float, out: Path) -> dict[str, Any]:
    """The run's config (what ``--config`` reads)."""
    return {
        "seed_everything": 0,
        "federation": {
            "rounds": args.rounds,
            "local_epochs": 1,
            "client_fraction": fraction,
            "eval_clients": args.eval_clients,
            "output_dir": str(out),
            "run_name": f"{method}-{clients}-{fraction}",
            "progress": False,
            "quiet": True,
            "plots": True,
            "checkpoint_every": 1,
        },
        "model": {
            "class_path": "fl_lightning.clients.ClassificationClient",
            "init_args": {
                "arch": "cnn",
                "width": 32,
                "norm": "batch",
                "lr": 0.1,
                "momentum": 0.0,
            },  # SCAFFOLD: plain SGD
        },
        "data": {
            "class_path": "datamodules.many_digits.ManyDigitsFederated",
            "init_args": {"num_clients": clients, "samples_per_client": 40, "alpha": 0.5, "image_size": 16},
        },
        "trainer": {
            "logger": False,
            "accelerator": "cpu",
            "callbacks": [{"class_path": c} for c in METHODS[method]],
        },
    }


# ---------------------------------------------------------------------------------------------- child process
def child(config_path: str, report_path: str, ckpt_round: int) -> None:
    """Run one configuration with probes on the Federation; write what they saw to ``report_path``."""
    from fl_lightning import federation as fed_module
    from fl_lightning.cli import main

    seen: dict[str, Any] = {"checkpoint_s": [], "checkpoint_bytes": 0}
    run_round, save = fed_module.Federation.run_round, fed_module.Federation.save_checkpoint

    def probed_round(self: Any, r: int) -> dict[str, Any]:
        seen.setdefault("first_round_wall", time.time())
        seen["federation"] = self
        return run_round(self, r)

    def probed_save(self: Any) -> Path:
        before = set(_store_files(self.run_dir.path))
        t0 = time.perf_counter()
        path = save(self)
        seen["checkpoint_s"].append(time.perf_counter() - t0)
        # what this save wrote: the checkpoint and the clients' state file of the clients that changed
        seen["checkpoint_bytes"] = path.stat().st_size + sum(
            p.stat().st_size for p in _store_files(self.run_dir.path) - before
        )
        return path

    fed_module.Federation.run_round, fed_module.Federation.save_checkpoint = probed_round, probed_save
    main(["--config", config_path])
    fed = seen.pop("federation")
    report = {k: v for k, v in seen.items()}
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(fed.run_dir.path / "rounds.csv", newline="") as f:  # read before checkpoint_at_round adds rows
        report["rounds"] = list(csv.DictReader(f))
    if ckpt_round:
        report["at_round"] = checkpoint_at_round(fed, ckpt_round)
    Path(report_path).write_text(json.dumps(report))


def _store_files(run_dir: Path) -> set[Path]:
    """The clients' state files of a run (beside its checkpoints)."""
    from fl_lightning.outputs.client_store import STORE_DIR

    return set((run_dir / "checkpoints" / STORE_DIR).glob("*"))


def checkpoint_at_round(fed: Any, rounds: int) -> dict[str, float]:
    """Checkpoint and records of round ``rounds``: the run's last round's rows repeated to that many rounds.

    Every client gets a callback state (SCAFFOLD: a c_i each, as once all have trained); "now" writes the clients
    one round changes (``client_fraction`` of them) beside the checkpoint, "before" wrote every client's state and
    every row into each checkpoint.
    """
    from fl_lightning.outputs.checkpoint import ClientStateStore, save_checkpoint, write_round_checkpoint
    from fl_lightning.outputs.run_dir import _csv_text, atomic_write_text

    run = fed.run_dir
    n = len(fed.data.client_ids)
    last_rows, last_round = run.client_rows[-n:], run.round_rows[-1]
    client_rows = [{**row, "round": r} for r in range(1, rounds + 1) for row in last_rows]
    round_rows = [{**last_round, "round": r} for r in range(1, rounds + 1)]
    run.client_rows, run.round_rows = client_rows[:-n], round_rows[:-1]
    run._headers = {}
    run.add_rows(client_rows[-n:], round_rows[-1])  # rewrites both files once (new headers): the history exists
    states = fed.transport.runtime.callback_states
    for cid in fed.data.client_ids if states else []:
        states.setdefault(cid, copy.deepcopy(next(iter(states.values()))))
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=run.path) as tmp:
        store = ClientStateStore()
        write_round_checkpoint(Path(tmp) / "round-00099.ckpt", fed.state_dict(), store, 2)  # the rounds before
        trained = fed.data.client_ids[: max(1, round(fed.config.client_fraction * n))]
        for cid in trained:  # what round 100 changes
            fed.transport.runtime.generations[cid] = fed.transport.runtime.generations.get(cid, 0) + 1
        before = set(Path(tmp).rglob("*"))
        path = Path(tmp) / "round-00100.ckpt"
        t0 = time.perf_counter()
        run.add_rows(last_rows, last_round)  # one more round's records: appended
        out["records_now_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        run.sync()
        write_round_checkpoint(path, fed.state_dict(), store, 2)
        out["checkpoint_now_s"] = time.perf_counter() - t0
        out["checkpoint_now_mb"] = sum(p.stat().st_size for p in set(Path(tmp).rglob("*")) - before) / 2**20
        t0 = time.perf_counter()  # before: metrics.csv and rounds.csv rewritten whole every round
        atomic_write_text(run.path / "metrics.csv", _csv_text(run.client_rows), durable=False)
        atomic_write_text(run.path / "rounds.csv", _csv_text(run.round_rows), durable=False)
        out["records_before_s"] = time.perf_counter() - t0
        old = Path(tmp) / "before.ckpt"
        t0 = time.perf_counter()  # before: every row in every checkpoint
        state = fed.state_dict()
        state["rows"] = {"clients": run.client_rows, "rounds": run.round_rows}
        save_checkpoint(old, state)
        out["checkpoint_before_s"] = time.perf_counter() - t0
        out["checkpoint_before_mb"] = old.stat().st_size / 2**20
    return out


# ---------------------------------------------------------------------------------------------- parent
def measure(args: argparse.Namespace, clients: int, method: str, fraction: float, out: Path) -> dict[str, Any]:
    """One configuration in a fresh process; returns the table's numbers."""
    path = out / f"{method}-{clients}-{fraction}.yaml"
    path.write_text(json.dumps(config(args, clients, method, fraction, out)))  # JSON is YAML
    report_path = out / f"{method}-{clients}-{fraction}.report.json"
    ckpt_round = args.ckpt_round if (clients == max(args.clients) and method != "fedbn" and fraction < 1) else 0
    cmd = [sys.executable, __file__, "--child", str(path), str(report_path), str(ckpt_round)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launched = time.time()
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    report = json.loads(report_path.read_text())
    rows = report["rounds"]
    train = [float(r["time/train"]) + float(r["time/aggregate"]) for r in rows[1:]] or [0.0]
    sampled_eval = [float(r["time/eval"]) for r in rows[:-1]] or [0.0]
    return {
        "clients": clients,
        "method": method,
        "trained per round": round(fraction * clients) or 1,
        "start-up s": report["first_round_wall"] - launched,
        "s/round": statistics.median(train),
        "eval s (sampled)": statistics.median(sampled_eval),
        "eval s (all, last)": float(rows[-1]["time/eval"]),
        "peak RSS MB": report["peak_rss_mb"],
        "checkpoint MB": report["checkpoint_bytes"] / 2**20,
        "checkpoint write s": statistics.median(report["checkpoint_s"]),
        "at_round": report.get("at_round"),
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's repeats: the median of each number (the first repeat's round-N measurement)."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(row[key] for row in rows)
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table."""
    keys = [k for k in results[0] if k != "at_round"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in results:
        cells = [f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    """Run every configuration (one process each) and print the table."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--eval-clients", type=float, default=0.1)
    parser.add_argument("--ckpt-round", type=int, default=100, help="0 = skip the round-N checkpoint measurement")
    parser.add_argument("--reference", action="store_true", help="also 100 of 100 clients per round (FedAvg)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats; the table shows medians")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        runs = [(n, m, args.fraction) for n in args.clients for m in args.methods]
        if args.reference:
            runs.append((round(args.fraction * max(args.clients)), "fedavg", 1.0))
        repeats: list[list[dict[str, Any]]] = [[] for _ in runs]
        for repeat in range(args.repeats):  # interleaved: each repeat runs every configuration once
            (out / f"repeat{repeat}").mkdir()
            for i, (clients, method, fraction) in enumerate(runs):
                row = measure(args, clients, method, fraction, out / f"repeat{repeat}")
                repeats[i].append(row)
                print(json.dumps(row), flush=True)
        results = [median_row(rows) for rows in repeats]
    print(markdown(results))
    for row in results:
        if row["at_round"]:
            print(f"\nround {args.ckpt_round}, {row['clients']} clients ({row['method']}):")
            for key, value in row["at_round"].items():
                print(f"  {key}: {value:.3f}")


if __name__ == "__main__":
    main()
