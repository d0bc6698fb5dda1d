"""What W1's `train.py` pays beyond its SGD steps, part by part, each against its own baseline in the same run.

The side-by-side benchmark (`../shared/bench/run.sh`) times whole processes, whose spread on a shared 2-core machine
(seconds from run to run) is larger than any one of these parts. This script times the parts alone, in one process,
alternating each with its baseline and keeping the best of ``--repeats``:

* **one `trainer.fit` per client**: ``LocalFitter.fit`` (the project's only training path) against a plain loop
  doing the same steps on the same module and loader; the difference per fit is Lightning's fixed cost (its set-up
  before the first batch, its teardown after the last, its dispatch per step). Times W1's 200 client fits.
* **the figures** of a W1 run (``federation.plots``): ``partition.png`` and ``sites.png`` at the start,
  ``curves.png`` at the end, drawn from W1's data (10 clients, Dirichlet 0.5, 32 px) and 20 rounds of rows.
* **the W&B run** (the default logger, offline): a fresh interpreter that imports ``wandb``, opens an offline run,
  logs 20 rows and finishes it, against a fresh interpreter that only starts.

    python benchmarks/fixed_costs.py [--repeats 5] [--fits 100]

Prints each part's time, its baseline, the difference and what it comes to on W1 (per process).
"""

# ruff: noqa: E402 (the imports of the repository follow the sys.path set-up)
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout, installed or not

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from datamodules import DigitsFederated
from fl_lightning import ClassificationClient
from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.outputs.plots import domain_counts, plot_curves, plot_partition
from fl_lightning.outputs.sites import plot_sites, site_examples
from fl_lightning.runtime.local_fit import LocalFitter

#: W1: 10 clients, 20 rounds, every client every round (../shared/bench/fl_w1.yaml).
W1_FITS = 200
WANDB_RUN = """
import tempfile, wandb
run = wandb.init(mode="offline", dir=tempfile.mkdtemp(), project="fixed-costs")
for step in range(20):
    run.log({"round": step, "acc": 0.5})
run.finish()
"""


def best(fn: Callable[[], None], repeats: int) -> float:
    """The shortest of ``repeats`` wall times of ``fn()``, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def fit_cost(fits: int, repeats: int) -> tuple[float, float]:
    """Seconds per client fit through ``LocalFitter`` and per plain loop of the same 4 steps (W1's mean is 4.5)."""
    warnings.filterwarnings("ignore")
    module = ClassificationClient(num_classes=10, in_channels=1, image_size=(8, 8), width=4, norm="none", lr=0.05)
    data = TensorDataset(torch.randn(128, 1, 8, 8), torch.randint(0, 10, (128,)))
    loader = DataLoader(data, batch_size=32, generator=torch.Generator().manual_seed(0))
    fitter = LocalFitter(L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False}))

    def lightning() -> None:
        for _ in range(fits):
            fitter.fit(module, loader, 1, "client")

    def plain() -> None:
        for _ in range(fits):
            optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
            module.train()
            for batch in loader:
                optimizer.zero_grad()
                module.training_loss(batch).backward()
                optimizer.step()

    lightning()  # warm-up: the first fits import and build what later ones reuse
    pairs = [(best(lightning, 1), best(plain, 1)) for _ in range(repeats)]
    return min(p[0] for p in pairs) / fits, min(p[1] for p in pairs) / fits


def figures_cost(repeats: int) -> tuple[float, float]:
    """Seconds for W1's two start figures and for its end figure (the first drawing of a process counted)."""
    data = DigitsFederated(num_clients=10, image_size=32, partition="dirichlet", alpha=0.5, site_styles=False, seed=0)
    data.setup("fit")
    ids = list(data.client_ids)
    rows = [{"round": r, "client": c, "global/acc": 0.5 + r / 50} for r in range(1, 21) for c in ids]
    with tempfile.TemporaryDirectory() as out:
        folder = Path(out)

        def start() -> None:
            counts = {c: data.label_counts(c).numpy() for c in ids}
            plot_partition(counts, folder / "partition.png", domain_counts(data), "samples")
            plot_sites(site_examples(data), folder / "sites.png", len(ids), data.label_names())

        first = best(start, 1)  # a process draws its first figure once: fonts and caches load then
        again = best(start, repeats)
        end = best(lambda: plot_curves(rows, folder / "curves.png"), repeats)
    return max(first, again), end


def wandb_cost(repeats: int) -> tuple[float, float]:
    """Seconds of a fresh interpreter with an offline W&B run, and of one that only starts."""
    env_python = sys.executable

    def run(code: str) -> Callable[[], None]:
        return lambda: subprocess.run([env_python, "-c", code], check=True, capture_output=True)

    pairs = [(best(run(WANDB_RUN), 1), best(run("pass"), 1)) for _ in range(repeats)]
    return min(p[0] for p in pairs), min(p[1] for p in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="alternate each part with its baseline this often")
    parser.add_argument("--fits", type=int, default=100, help="client fits per timing")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the steadiest timings; W1's steps use 2 threads, its fixed costs mostly 1
    per_fit, per_loop = fit_cost(args.fits, args.repeats)
    start, end = figures_cost(args.repeats)
    with_wandb, bare = wandb_cost(args.repeats)
    lightning = (per_fit - per_loop) * W1_FITS
    print(f"one trainer.fit per client : {per_fit * 1e3:6.2f} ms per fit, plain loop {per_loop * 1e3:6.2f} ms: "
          f"+{(per_fit - per_loop) * 1e3:.2f} ms per fit, {lightning:.2f} s over W1's {W1_FITS} fits")  # fmt: skip
    print(f"figures (federation.plots) : start {start:.2f} s, end {end:.2f} s: {start + end:.2f} s per W1 run")
    print(f"W&B offline run            : {with_wandb:.2f} s against {bare:.2f} s: {with_wandb - bare:.2f} s per run")
    print(f"together                   : {lightning + start + end + with_wandb - bare:.2f} s per W1 process")


if __name__ == "__main__":
    main()
