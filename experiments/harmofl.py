"""HarmoFL and its baselines under feature shift, on the two embedded tasks.

Methods: FedAvg, FedProx (μ = 0.01), FedBN, HarmoFL (amplitude normalisation v = 0.1, band 1 +
weight perturbation α = 0.05), HarmoFL without amplitude normalisation (WP only) and HarmoFL
without weight perturbation (AN only).

Tasks (5 sites, each with its own imaging style: clean; gamma + low contrast; inverted; blurred +
gain; noisy + low contrast; 1 local epoch per round, all sites every round):

- ``digits``: classification of the 10 digits, 16 px, SmallCNN (width 16, BatchNorm), SGD lr 0.05
  momentum 0.9, batch 32;
- ``digits_seg``: segmentation of three digits of {0, 1, 3, 4} per image (5 classes with
  background), 24 px, 500 images, small UNet (width 8, depth 2, BatchNorm), Adam lr 3e-3, batch 16,
  loss CE + soft Dice (Adam 3e-3, not the paper's 1e-4, so that 15 short CPU rounds get somewhere).

Reported per method: the final test metric (accuracy; foreground Dice) of the model each site
uses — the personalised model, which is the global model except for FedBN (global weights + the
site's own BatchNorm) — as the mean over sites, the std across sites and the worst site; each as
mean ± std over the seeds. Runs are small so that the whole script takes about 15 minutes on
2 CPU cores; the numbers are a small-budget comparison, not a reproduction of the paper's.

    python experiments/harmofl.py [--seeds 0 1 2] [--rounds-digits 15] [--rounds-seg 15] \
        [--out experiments/results/harmofl]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from callbacks import AmplitudeNormalization, FedBN, FedProx, WeightPerturbation  # noqa: E402
from datamodules import DigitsFederated, DigitsSegFederated  # noqa: E402
from fl_lightning import FederationConfig, local_federation  # noqa: E402
from fl_lightning.cli import TRAINER_DEFAULTS  # noqa: E402
from fl_lightning.clients import ClassificationClient, SegmentationClient  # noqa: E402

METHODS: dict[str, Callable[[], list[L.Callback]]] = {
    "FedAvg": lambda: [],
    "FedProx": lambda: [FedProx(mu=0.01)],
    "FedBN": lambda: [FedBN()],
    "HarmoFL": lambda: [AmplitudeNormalization(v=0.1, band=1.0), WeightPerturbation(alpha=0.05)],
    "HarmoFL w/o AN": lambda: [WeightPerturbation(alpha=0.05)],
    "HarmoFL w/o WP": lambda: [AmplitudeNormalization(v=0.1, band=1.0)],
}
TASKS = {"digits": "acc", "digits_seg": "dice"}  # task: reported metric


def build(task: str, seed: int) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The task's datamodule and a freshly initialised client module (seeded)."""
    torch.manual_seed(seed)
    if task == "digits":
        data = DigitsFederated(num_clients=5, image_size=16, partition="iid", site_styles=True, seed=seed)
        model = ClassificationClient(
            num_classes=data.num_classes, in_channels=1, image_size=data.image_size, width=16, lr=0.05, momentum=0.9
        )
        return model, data
    data = DigitsSegFederated(num_clients=5, image_size=24, num_samples=500, site_styles=True, seed=seed)
    model = SegmentationClient(
        num_classes=data.num_classes, in_channels=1, image_size=data.image_size, width=8, depth=2, lr=3e-3
    )
    return model, data


def run_one(method: str, task: str, seed: int, rounds: int, out: Path) -> dict:
    """One federated run; returns its final per-site metric and a per-round curve of the site mean."""
    model, data = build(task, seed)
    trainer = L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False, "callbacks": METHODS[method]()})
    cfg = FederationConfig(rounds=rounds, output_dir=str(out), progress=False, plots=False, checkpoint_every=0)
    fed = local_federation(cfg, model, data, trainer, seed=seed)
    start = time.perf_counter()
    summary = fed.run()
    metric = TASKS[task]
    stats = summary["summary"]["personal"][metric]
    return {
        "method": method, "task": task, "seed": seed, "rounds": rounds, "metric": metric,
        "seconds": time.perf_counter() - start, "mean": stats["mean"], "client_std": stats["std"],
        "worst": stats["worst"], "global_mean": summary["summary"]["global"][metric]["mean"],
        "curve": [row[f"eval/personal/{metric}"] for row in fed.run_dir.round_rows],
    }  # fmt: skip


def _pm(values: list[float]) -> str:
    return f"{np.mean(values):.4f} ± {np.std(values):.4f}"


def table(results: list[dict]) -> tuple[str, dict]:
    """The markdown table and its numbers (mean and std over seeds of each reported quantity)."""
    lines, numbers = [], {}
    for task, metric in TASKS.items():
        rows = [r for r in results if r["task"] == task]
        if not rows:
            continue
        seeds = sorted({r["seed"] for r in rows})
        label = "accuracy" if metric == "acc" else "foreground Dice"
        lines += [
            f"\n**{task}** — test {label} of the model each site uses, {rows[0]['rounds']} rounds, "
            f"seeds {seeds} (mean ± std over seeds)\n",
            "| method | mean over sites | std across sites | worst site | s / run |",
            "|---|---|---|---|---|",
        ]
        for method in METHODS:
            rs = [r for r in rows if r["method"] == method]
            if not rs:
                continue
            cells = {k: [r[k] for r in rs] for k in ("mean", "client_std", "worst", "seconds")}
            numbers.setdefault(task, {})[method] = {
                k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "n": len(v)} for k, v in cells.items()
            }
            lines.append(
                f"| {method} | {_pm(cells['mean'])} | {_pm(cells['client_std'])} | {_pm(cells['worst'])} "
                f"| {np.mean(cells['seconds']):.0f} |"
            )
    return "\n".join(lines) + "\n", numbers


def plot(results: list[dict], path: Path) -> None:
    """Bars of the site mean (± std over seeds) per method and task, and the mean learning curves."""
    fig, axes = plt.subplots(2, len(TASKS), figsize=(6 * len(TASKS), 8), squeeze=False)
    for col, (task, metric) in enumerate(TASKS.items()):
        rows = [r for r in results if r["task"] == task]
        methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
        means = [np.mean([r["mean"] for r in rows if r["method"] == m]) for m in methods]
        errs = [np.std([r["mean"] for r in rows if r["method"] == m]) for m in methods]
        spread = [np.mean([r["client_std"] for r in rows if r["method"] == m]) for m in methods]
        ax = axes[0][col]
        x = np.arange(len(methods))
        ax.bar(x, means, yerr=errs, capsize=4, color=plt.get_cmap("tab10")(x % 10))
        ax.errorbar(x + 0.25, means, yerr=spread, fmt="none", ecolor="grey", capsize=2, label="std across sites")
        ax.set_xticks(x, methods, rotation=30, ha="right")
        ax.set_ylim(max(0.0, min(means) - 0.15), min(1.0, max(means) + 0.08) if means else 1.0)
        ax.set_title(f"{task}: final test {metric} (mean over sites)")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(axis="y", alpha=0.3)
        ax = axes[1][col]
        for i, m in enumerate(methods):
            curves = np.array([r["curve"] for r in rows if r["method"] == m])
            ax.plot(np.arange(1, curves.shape[1] + 1), curves.mean(0), label=m, color=plt.get_cmap("tab10")(i % 10))
        ax.set_xlabel("round")
        ax.set_ylabel(f"mean test {metric} over sites")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds-digits", type=int, default=15)
    parser.add_argument("--rounds-seg", type=int, default=15)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path("experiments/results/harmofl"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["method"], r["task"], r["seed"]) for r in results}
    rounds = {"digits": args.rounds_digits, "digits_seg": args.rounds_seg}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for task in args.tasks:
                for method in args.methods:
                    if (method, task, seed) in done:
                        continue  # the script resumes where it stopped
                    result = run_one(method, task, seed, rounds[task], Path(tmp))
                    results.append(result)
                    results_path.write_text(json.dumps(results, indent=1))
                    line = f"seed {seed} {task:10s} {method:15s} {result['metric']} {result['mean']:.4f}"
                    print(f"{line} ± {result['client_std']:.4f} across sites ({result['seconds']:.0f}s)", flush=True)
    text, numbers = table(results)
    (args.out / "table.md").write_text(text)
    (args.out / "table.json").write_text(json.dumps(numbers, indent=1))
    plot(results, args.out / "harmofl.png")
    print(text)


if __name__ == "__main__":
    main()
