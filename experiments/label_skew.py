"""Label-skew comparison on the embedded digits.

Methods: FedAvg, FedProx, SCAFFOLD, FedNova, FedAdam, MOON, Reweighting, FedShift.

Settings (issue "FedShift and the label-skew baselines"): Dirichlet α ∈ {0.1, 0.5} with 10 clients
all participating, and 50 clients with 10 sampled per round (α = 0.5); 3 seeds each. Every method
uses the same data, model (SmallCNN, 16 px), local optimiser (SGD lr 0.05, no momentum, batch 32,
1 local epoch) and evaluation. Reported: final accuracy of the global model on the pooled test set
(the union of the clients' test sets, i.e. the balanced digit distribution) and the mean over
clients of their own test sets, mean ± std over seeds; and the rounds a method needs to reach
FedAvg's final pooled accuracy (same seed and setting; "never" counts as not reached).

    python experiments/label_skew.py [--rounds 30] [--seeds 0 1 2] [--out experiments/results/label_skew]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch

from callbacks import ClassifierShift, FedNova, FedOpt, FedProx, Moon, Reweighting, Scaffold
from datamodules import DigitsFederated
from fl_lightning import ClassificationClient, FederationConfig, local_federation
from fl_lightning.cli import TRAINER_DEFAULTS

METHODS: dict[str, Callable[[], list[L.Callback]]] = {
    "FedAvg": lambda: [],
    "FedProx": lambda: [FedProx(mu=0.01)],
    "SCAFFOLD": lambda: [Scaffold()],
    "FedNova": lambda: [FedNova()],
    "FedAdam": lambda: [FedOpt("adam", lr=1e-2)],
    "MOON": lambda: [Moon(mu=5.0, temperature=0.5)],
    "Reweighting": lambda: [Reweighting()],
    "FedShift": lambda: [ClassifierShift(tau=1.0)],
}
SETTINGS = {  # name: (alpha, clients, clients per round)
    "a0.1-c10": (0.1, 10, 10),
    "a0.5-c10": (0.5, 10, 10),
    "a0.5-c50-s10": (0.5, 50, 10),
}


def run_one(method: str, setting: str, seed: int, rounds: int, out: Path) -> dict:
    alpha, clients, per_round = SETTINGS[setting]
    data = DigitsFederated(
        num_clients=clients, partition="dirichlet", alpha=alpha, site_styles=False, image_size=16, seed=seed
    )
    torch.manual_seed(seed)
    model = ClassificationClient(
        num_classes=data.num_classes, in_channels=1, image_size=data.image_size, lr=0.05, momentum=0.0
    )
    trainer = L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False, "callbacks": METHODS[method]()})
    cfg = FederationConfig(
        rounds=rounds, clients_per_round=per_round, output_dir=str(out), progress=False, plots=False,
        checkpoint_every=0,
    )  # fmt: skip
    fed = local_federation(cfg, model, data, trainer, seed=seed)
    start = time.perf_counter()
    summary = fed.run()
    curve = [row["eval/pooled/acc"] for row in fed.run_dir.round_rows]
    return {
        "method": method, "setting": setting, "seed": seed, "seconds": time.perf_counter() - start,
        "pooled_acc": summary["pooled"]["acc"], "client_acc": summary["summary"]["global"]["acc"]["mean"],
        "worst_client_acc": summary["summary"]["global"]["acc"]["worst"], "pooled_curve": curve,
    }  # fmt: skip


def rounds_to_reach(curve: list[float], target: float) -> int | None:
    """First round (1-based) whose accuracy reaches ``target``, or None."""
    return next((r + 1 for r, acc in enumerate(curve) if acc >= target - 1e-12), None)


def table(results: list[dict], rounds: int) -> str:
    lines = []
    for setting in SETTINGS:
        lines += [
            f"\n**{setting}** (α = {SETTINGS[setting][0]}, {SETTINGS[setting][1]} clients, "
            f"{SETTINGS[setting][2]} per round, {rounds} rounds)\n",
            "| method | pooled test acc | mean client acc | worst client acc | rounds to FedAvg's final acc |",
            "|---|---|---|---|---|",
        ]
        fedavg = {r["seed"]: r["pooled_acc"] for r in results if r["setting"] == setting and r["method"] == "FedAvg"}
        for method in METHODS:
            rs = [r for r in results if r["setting"] == setting and r["method"] == method]
            if not rs:
                continue
            cells = [_pm([r[k] for r in rs]) for k in ("pooled_acc", "client_acc", "worst_client_acc")]
            reach = [rounds_to_reach(r["pooled_curve"], fedavg[r["seed"]]) for r in rs if r["seed"] in fedavg]
            reached = [x for x in reach if x is not None]
            reach_cell = (_pm(reached, digits=1) if reached else "never") + (
                f" ({len(reach) - len(reached)}/{len(reach)} never)" if len(reached) < len(reach) else ""
            )
            lines.append(f"| {method} | {' | '.join(cells)} | {reach_cell} |")
    return "\n".join(lines) + "\n"


def _pm(values: list[float], digits: int = 4) -> str:
    return f"{np.mean(values):.{digits}f} ± {np.std(values):.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path("experiments/results/label_skew"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["method"], r["setting"], r["seed"]) for r in results}
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.settings:
            for seed in args.seeds:
                for method in args.methods:
                    if (method, setting, seed) in done:
                        continue  # the script resumes where it stopped
                    result = run_one(method, setting, seed, args.rounds, Path(tmp))
                    results.append(result)
                    results_path.write_text(json.dumps(results, indent=1))
                    print(f"{setting} seed {seed} {method:12s} pooled {result['pooled_acc']:.4f} "
                          f"({result['seconds']:.0f}s)", flush=True)  # fmt: skip
    text = table(results, args.rounds)
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
