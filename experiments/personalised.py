"""Personalised FL on the embedded digits: every personalised method against FedAvg, FedAvg+FT, FedBN and local.

Settings (issue "Personalised federated learning"): feature shift (``configs/*_digits.yaml``: 5 sites, each its own
imaging style, IID labels) and label skew (``configs/*_digits_dirichlet.yaml`` at Dirichlet α = 0.1: 10 sites,
no styles); 3 seeds each. Every method runs its shipped config through ``train.py``'s entry point, with only the
seed, α and the output switched; so the data, model, local optimiser, rounds and evaluation are the configs'.

Reported per method: the global model's and the personal model's mean and worst client test accuracy (each client
on its own test set), mean ± std over seeds. The personal model is each client's own as it is evaluated (FedAvg's
is the global model; FedAvg+FT's and FedBABU's are the fine-tuned ones; local's the client's lone model).

    python experiments/personalised.py [--seeds 0 1 2] [--settings feature label] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fl_lightning.cli import main as train

FT = ["--trainer.callbacks+=callbacks.LocalFineTuning", "--trainer.callbacks.epochs=1"]
# method: (config stem, extra arguments); "{s}" is "" (feature shift) or "_dirichlet" (label skew)
METHODS: dict[str, tuple[str, list[str]]] = {
    "FedAvg": ("fedavg_digits{s}", []),
    "FedAvg+FT": ("fedavg_digits{s}", FT),
    "FedBN": ("fedavg_digits{s}", ["--trainer.callbacks+=callbacks.FedBN"]),
    "local": ("fedavg_digits{s}", ["--federation.mode=local"]),
    "FedPer": ("fedper_digits{s}", []),
    "FedRep": ("fedrep_digits{s}", []),
    "LG-FedAvg": ("lg_fedavg_digits{s}", []),
    "FedBABU": ("fedbabu_digits{s}", []),
    "Ditto": ("ditto_digits{s}", []),
    "Ditto λ=1": ("ditto_digits{s}", ["--trainer.callbacks.lam=1.0"]),
    "MR-MTL": ("mr_mtl_digits{s}", []),
    "APFL": ("apfl_digits{s}", []),
    "FedALA": ("fedala_digits{s}", []),
}
SETTINGS = {"feature": ("", []), "label": ("_dirichlet", ["--data.init_args.alpha=0.1"])}


def stats(summary: dict, model: str) -> tuple[float, float] | None:
    """(mean, worst) client accuracy of ``model`` in a summary, or None if it was not evaluated."""
    acc = summary.get("summary", {}).get(model, {}).get("acc")
    return None if acc is None else (acc["mean"], acc["worst"])


def run_one(method: str, setting: str, seed: int, out: Path) -> dict:
    stem, extra = METHODS[method]
    suffix, data_args = SETTINGS[setting]
    config = Path("configs") / f"{stem.format(s=suffix)}.yaml"
    start = time.perf_counter()
    summary = train([
        "--config", str(config), *extra, *data_args, f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
        "--trainer.logger=false", "--federation.progress=false", "--federation.plots=false",
        "--federation.quiet=true", "--federation.checkpoint_every=0", f"--federation.output_dir={out}",
        f"--federation.run_name={method}-{setting}-{seed}",
    ])  # fmt: skip
    personal_model = "finetuned" if "finetuned" in summary.get("summary", {}) else "personal"
    glob, pers = stats(summary, "global"), stats(summary, personal_model) or stats(summary, "global")
    ages = [c.get("personal_rounds_old") for c in summary["clients"].values() if "personal_rounds_old" in c]
    return {
        "method": method, "setting": setting, "seed": seed, "seconds": time.perf_counter() - start,
        "config": str(config), "args": extra + data_args,
        "global_mean": None if glob is None else glob[0], "global_worst": None if glob is None else glob[1],
        "personal_mean": pers[0], "personal_worst": pers[1], "personal_model": personal_model,
        "max_personal_rounds_old": max(ages) if ages else None,
    }  # fmt: skip


def _pm(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]
    return f"{np.mean(values):.4f} ± {np.std(values):.4f}" if values else "—"


def table(results: list[dict]) -> str:
    lines = []
    for setting, title in (("feature", "Feature shift (5 sites, five imaging styles)"),
                           ("label", "Label skew (10 sites, Dirichlet α = 0.1)")):  # fmt: skip
        rows = [r for r in results if r["setting"] == setting]
        if not rows:
            continue
        seeds = sorted({r["seed"] for r in rows})
        lines += [f"\n**{title}**, seeds {', '.join(map(str, seeds))}\n",
                  "| method | global mean | global worst | personal mean | personal worst |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for method in METHODS:
            rs = [r for r in rows if r["method"] == method]
            if rs:
                cells = [_pm([r[k] for r in rs]) for k in ("global_mean", "global_worst", "personal_mean",
                                                            "personal_worst")]  # fmt: skip
                lines.append(f"| {method} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path("experiments/results/personalised"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--table-only", action="store_true", help="only rewrite table.md from results*.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    args.out.mkdir(parents=True, exist_ok=True)
    # one results file per seed set, so two processes (one per core) can run seeds side by side
    results_path = args.out / f"results-{'-'.join(map(str, args.seeds))}.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["method"], r["setting"], r["seed"]) for r in results}
    if not args.table_only:
        with tempfile.TemporaryDirectory() as tmp:
            for setting in args.settings:
                for seed in args.seeds:
                    for method in args.methods:
                        if (method, setting, seed) in done:
                            continue  # the script resumes where it stopped
                        result = run_one(method, setting, seed, Path(tmp))
                        results.append(result)
                        results_path.write_text(json.dumps(results, indent=1))
                        print(f"{setting} seed {seed} {method:10s} global {result['global_mean']} personal "
                              f"{result['personal_mean']:.4f} ({result['seconds']:.0f}s)", flush=True)  # fmt: skip
    every = [r for path in sorted(args.out.glob("results-*.json")) for r in json.loads(path.read_text())]
    text = table(every)
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
