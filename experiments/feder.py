"""FedER, FedER-A, FedER-B and their baselines on the same three digit nodes.

Every run is configs/feder_digits.yaml (3 nodes with strong site shift: clean; gamma + low contrast;
inverted; SmallCNN, SGD lr 0.05 momentum 0.9, batch 32, 1 local epoch, 10 rounds) with only the method
changed, built through the same CLI as train.py:

- FedER / FedER-A / FedER-B: configs/feder_digits.yaml, feder_a_digits.yaml, feder_b_digits.yaml;
- FedAvg / FedProx (μ = 0.01) / FedBN: --federation.topology=star and the method's callbacks;
- local: --federation.mode=local; centralised (real): --federation.mode=centralized;
- centralised on synthetic data only / on real + synthetic data: centralised mode on
  datamodules.SyntheticFederated (each node's training set replaced by / joined with its FedER buffer).

The GAN phase runs once: its seeds come from gan.seed and the node, not from seed_everything, so the first
FedER run trains and saves the generators and every later run reuses them (generators_from). The 3 seeds vary
seed_everything (model initialisation, the peer-to-peer cycle, replay draws) on the same nodes and the same
synthetic data. Reported: every node's final model on every node's test set (for methods with one model,
that model on every test set), mean over the node × test-set pairs and the worst pair, then mean ± std
over seeds; and each node's model on its own test set.

    python experiments/feder.py [--seeds 0 1 2] [--out experiments/results/feder]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from callbacks import ExperienceReplay
from datamodules import SyntheticFederated
from fl_lightning import Federation, local_federation
from fl_lightning.cli import build_cli, config_yaml

STAR = ["--federation.topology=star", "--trainer.callbacks=[]"]
METHODS: dict[str, tuple[str, list[str]]] = {  # name: (config, overrides)
    "FedER": ("feder_digits.yaml", []),
    "FedER-A (buffers only travel)": ("feder_a_digits.yaml", []),
    "FedER-B (synthetic only)": ("feder_b_digits.yaml", []),
    "FedAvg": ("feder_digits.yaml", STAR),
    "FedProx": ("feder_digits.yaml", [STAR[0], '--trainer.callbacks=[{"class_path": "callbacks.FedProx"}]']),
    "FedBN": ("feder_digits.yaml", [STAR[0], '--trainer.callbacks=[{"class_path": "callbacks.FedBN"}]']),
    "local only": ("feder_digits.yaml", [*STAR, "--federation.mode=local"]),
    "centralised (real)": ("feder_digits.yaml", [*STAR, "--federation.mode=centralized"]),
    "centralised (synthetic only)": ("feder_digits.yaml", [*STAR, "--federation.mode=centralized"]),
    "centralised (real + synthetic)": ("feder_digits.yaml", [*STAR, "--federation.mode=centralized"]),
}
SYNTHETIC = {"centralised (synthetic only)": "synthetic", "centralised (real + synthetic)": "real_and_synthetic"}


def node_matrix(fed: Federation) -> dict[str, dict[str, float]]:
    """Accuracy of each node's final model (group model + the node's private state) on each node's test set."""
    module, group, ids = fed.module, fed.groups[0], fed.data.client_ids
    out = {}
    for holder in ids:
        module.load_state_dict({**group.state, **fed.transport.private.get((group.name, holder), {})})
        out[holder] = {t: module.evaluate(fed.data.client_test_loader(t), fed.device)["acc"] for t in ids}
    return out


def run_one(
    method: str, seed: int, out: Path, generators: Path | None, extra: list[str]
) -> tuple[dict[str, Any], Path]:
    config, overrides = METHODS[method]
    args = ["--config", f"configs/{config}", *overrides, *extra, f"--seed_everything={seed}",
            "--trainer.logger=false", "--trainer.accelerator=cpu", "--federation.progress=false",
            "--federation.plots=false", "--federation.eval_every=0", "--federation.checkpoint_every=0",
            f"--federation.output_dir={out}"]  # fmt: skip
    cli = build_cli(args)
    data = cli.datamodule
    if method in SYNTHETIC:
        data = SyntheticFederated(data, str(generators), train_on=SYNTHETIC[method])
    for cb in cli.trainer.callbacks:
        if isinstance(cb, ExperienceReplay) and generators is not None:
            cb.generators_from = str(generators)  # the GAN phase ran once, in the first FedER run
    config_text = config_yaml(cli.parser, cli.config)  # config.yaml: what the privacy audit rebuilds
    fed = local_federation(
        cli.config_init["federation"], cli.model, data, cli.trainer, seed=seed, config_text=config_text
    )
    start = time.perf_counter()
    fed.run()
    matrix = node_matrix(fed)
    pairs = [acc for row in matrix.values() for acc in row.values()]
    result = {
        "method": method, "seed": seed, "seconds": time.perf_counter() - start, "matrix": matrix,
        "cross_acc": float(np.mean(pairs)), "worst_pair_acc": float(np.min(pairs)),
        "own_acc": float(np.mean([matrix[c][c] for c in matrix])),
    }  # fmt: skip
    return result, fed.run_dir.path


def table(results: list[dict[str, Any]], gan_seconds: float | None) -> str:
    lines = [
        "| method | node models on all test sets (acc) | worst (model, test set) pair | own test set |",
        "|---|---|---|---|",
    ]
    for method in METHODS:
        rs = [r for r in results if r["method"] == method]
        if rs:
            cells = [_pm([r[k] for r in rs]) for k in ("cross_acc", "worst_pair_acc", "own_acc")]
            lines.append(f"| {method} | {' | '.join(cells)} |")
    seeds = sorted({r["seed"] for r in results})
    note = f"\n\nmean ± std over seeds {seeds}"
    if gan_seconds is not None:
        note += f"; GAN phase (3 nodes, once): {gan_seconds:.0f} s"
    return "\n".join(lines) + note + "\n"


def _pm(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=Path("experiments/results/feder"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--audit-real", type=int, default=160, help="real images per node in the audit (0: skip)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="extra train.py overrides for every run, e.g. --set=--federation.rounds=2",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter.*")
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.json"
    saved = json.loads(results_path.read_text()) if results_path.exists() else {"runs": [], "gan_seconds": None}
    done = {(r["method"], r["seed"]) for r in saved["runs"]}
    with tempfile.TemporaryDirectory() as tmp:
        gan_run: Path | None = None
        # The first FedER run trains the GANs (again, if the script resumes); every later run reuses its generators.
        todo = sorted(((m, s) for s in args.seeds for m in ["FedER", *args.methods]), key=lambda ms: ms[0] != "FedER")
        for method, seed in dict.fromkeys(todo):
            if (method, seed) in done and gan_run is not None:
                continue
            generators = gan_run / "generators" if gan_run else None
            result, run_dir = run_one(method, seed, Path(tmp), generators, args.set)
            if gan_run is None:
                gan_run = run_dir
                saved["gan_seconds"] = saved["gan_seconds"] or result["seconds"] - _federation_seconds(run_dir)
            if (method, seed) not in done:
                saved["runs"].append(result)
                results_path.write_text(json.dumps(saved, indent=1))
            print(f"seed {seed} {method:32s} cross {result['cross_acc']:.4f} own {result['own_acc']:.4f} "
                  f"({result['seconds']:.0f}s)", flush=True)  # fmt: skip
        text = table(saved["runs"], saved["gan_seconds"])
        if args.audit_real:
            from callbacks.feder.privacy_audit import audit

            start = time.perf_counter()
            found = audit(gan_run, out=Path(tmp) / "audit", max_real=args.audit_real)  # trains the α = 0 reference
            for name in ("privacy_audit.json", "privacy_audit.png"):
                shutil.copyfile(Path(tmp) / "audit" / name, args.out / name)
            text += "\n" + audit_table(found, args.audit_real, time.perf_counter() - start)
    (args.out / "table.md").write_text(text)
    print(text)


def audit_table(found: dict[str, Any], max_real: int, seconds: float) -> str:
    lines = [
        f"Privacy audit ({max_real} real training images per node, LPIPS distance to the closest synthetic image):\n",
        "| generators | closest of 2000 samples: median | 5th percentile | latent search: median | 5th percentile |",
        "|---|---|---|---|---|",
    ]
    for name, e in found["sets"].items():
        cells = [e[s][q] for s in ("sample", "latent") for q in ("median", "p05")]
        lines.append(f"| {name} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    ref = found["real_to_real"]
    lines.append(f"| (closest other real image) | {ref['median']:.4f} | {ref['p05']:.4f} | | |")
    return "\n".join(lines) + f"\n\naudit: {seconds:.0f} s\n"


def _federation_seconds(run_dir: Path) -> float:
    """Seconds the rounds themselves took (rounds.csv), to tell the GAN phase apart."""
    import csv

    with (run_dir / "rounds.csv").open() as f:
        return sum(float(row["time/round"]) for row in csv.DictReader(f))


if __name__ == "__main__":
    main()
