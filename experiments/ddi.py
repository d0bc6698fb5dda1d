"""Deep Domain Isolation + sample-clustered FL against FedAvg, FedAvg+ and CFL on the inverted-digits task.

The task (``configs/scfl_digits_seg.yaml``): segmentation of three digits of {0, 1, 3, 4} per 32-px
image (5 classes with background), 1000 images over 10 clients, half of all images intensity-inverted
(the second domain), small UNet with InstanceNorm, Adam 1e-3 decayed by 0.95 per round
(``callbacks.LRSchedule``), 30 rounds, split / clustering at round 10.

Splits of the two domains over the clients (``--data.partition``):

- ``iid``: every client holds both domains;
- ``domain``: full non-IID, half the clients hold one domain only, half the other;
- ``dirichlet_domain``: domain proportions per client ~ Dirichlet(β = 0.25).

Methods, three runs per split and seed, each through ``train.py``'s ``main`` with the shipped config:

- ``configs/fedavg_ft_digits_seg.yaml``: FedAvg (the global model) and FedAvg+ (the global model
  fine-tuned 1 local epoch on each client, ``callbacks.LocalFineTuning``) — one run gives both, the
  fine-tuning leaves the federated run untouched;
- ``configs/cfl_digits_seg.yaml``: CFL, clients bipartitioned at round 10 (the model each client uses);
- ``configs/scfl_digits_seg.yaml``: sample-clustered FL after DDI (pruned to 1 %), test images routed by
  the SCAFFOLD-trained cluster selector ("SCFL + selector") or by their true domain ("SCFL + oracle");
  also the Rand / adjusted Rand index of the sample clustering against the true domain.

Reported per split and method: mIoU and foreground Dice on the clients' test sets (mean over clients),
the std of Dice across clients and the worst client's Dice, each as mean ± std over the seeds.

    python experiments/ddi.py [--seeds 0 1 2] [--splits iid domain dirichlet_domain] [--jobs 2] \
        [--rounds 30] [--out experiments/results/ddi]

The script resumes: finished runs are kept in ``results.json`` and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import numpy as np

SPLITS = ("iid", "domain", "dirichlet_domain")
RUNS = {  # run name: (config, {method row: evaluated model})
    "fedavg_ft": ("configs/fedavg_ft_digits_seg.yaml", {"FedAvg": "global", "FedAvg+ (1 epoch)": "finetuned"}),
    "cfl": ("configs/cfl_digits_seg.yaml", {"CFL": "personal"}),
    "scfl": ("configs/scfl_digits_seg.yaml", {"SCFL + selector": "selector", "SCFL + oracle": "oracle"}),
}
METRICS = ("miou", "dice")


def run_one(run: str, split: str, seed: int, rounds: int, out: str) -> dict:
    """One federated run through the CLI; returns per method row the client-level metrics."""
    import torch

    torch.set_num_threads(1)  # one run per core
    os.environ["WANDB_MODE"] = "disabled"
    sys.argv = sys.argv[:1]  # the CLI gets its arguments below, not this script's
    from fl_lightning.cli import main

    config, rows = RUNS[run]
    start = time.perf_counter()
    summary = main(
        [
            f"--config={config}",
            f"--seed_everything={seed}",
            f"--data.seed={seed}",
            f"--data.partition={split}",
            f"--federation.rounds={rounds}",
            "--federation.eval_every=0",
            "--federation.progress=false",
            "--federation.checkpoint_every=0",
            f"--federation.output_dir={out}",
            f"--federation.run_name={run}-{split}-s{seed}",
            "--trainer.logger=false",
        ]
    )
    result = {"run": run, "split": split, "seed": seed, "rounds": rounds, "seconds": time.perf_counter() - start}
    result["methods"] = {
        method: {
            metric: {k: summary["summary"][model][metric][k] for k in ("mean", "std", "worst")} for metric in METRICS
        }
        for method, model in rows.items()
    }
    if "domain_isolation" in summary:
        result["clustering"] = {k: summary["domain_isolation"][k] for k in ("rand_index", "adjusted_rand_index")}
    return result


def _pm(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}"


def table(results: list[dict]) -> tuple[str, dict]:
    """One markdown table per split, and its numbers (mean and std over seeds)."""
    lines, numbers = [], {}
    for split in SPLITS:
        rows = [r for r in results if r["split"] == split]
        if not rows:
            continue
        seeds = sorted({r["seed"] for r in rows})
        lines += [
            f"\n**{split}** — {rows[0]['rounds']} rounds, seeds {seeds} (mean ± std over seeds)\n",
            "| method | mIoU | Dice | Dice std across clients | worst client Dice | Rand index | adj. Rand | s / run |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for run, (_, methods) in RUNS.items():
            rs = [r for r in rows if r["run"] == run]
            if not rs:
                continue
            for method in methods:
                cells = {
                    "miou": [r["methods"][method]["miou"]["mean"] for r in rs],
                    "dice": [r["methods"][method]["dice"]["mean"] for r in rs],
                    "dice_client_std": [r["methods"][method]["dice"]["std"] for r in rs],
                    "dice_worst": [r["methods"][method]["dice"]["worst"] for r in rs],
                }
                clustering = ["–", "–"]
                if all("clustering" in r for r in rs):
                    cells["rand_index"] = [r["clustering"]["rand_index"] for r in rs]
                    cells["adjusted_rand_index"] = [r["clustering"]["adjusted_rand_index"] for r in rs]
                    clustering = [_pm(cells["rand_index"]), _pm(cells["adjusted_rand_index"])]
                numbers.setdefault(split, {})[method] = {
                    k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "n": len(v)} for k, v in cells.items()
                }
                row = [method, *(_pm(cells[k]) for k in ("miou", "dice", "dice_client_std", "dice_worst"))]
                seconds = f"{np.mean([r['seconds'] for r in rs]):.0f}"
                lines.append("| " + " | ".join([*row, *clustering, seconds]) + " |")
    return "\n".join(lines) + "\n", numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one CPU thread each)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/ddi"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["run"], r["split"], r["seed"]) for r in results}
    todo = [
        (run, split, seed)
        for seed in args.seeds
        for split in args.splits
        for run in args.runs
        if (run, split, seed) not in done  # the script resumes where it stopped
    ]
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(run_one, run, split, seed, args.rounds, tmp) for run, split, seed in todo]
        for future in as_completed(futures):
            result = future.result()
            results.append(result)
            results_path.write_text(json.dumps(results, indent=1))
            dice = ", ".join(f"{m} {v['dice']['mean']:.3f}" for m, v in result["methods"].items())
            print(f"{result['split']:16s} seed {result['seed']} {result['run']:9s} Dice: {dice} "
                  f"({result['seconds']:.0f}s)", flush=True)  # fmt: skip
    text, numbers = table(results)
    (args.out / "table.md").write_text(text)
    (args.out / "table.json").write_text(json.dumps(numbers, indent=1))
    print(text)


if __name__ == "__main__":
    main()
