"""Lightning's own cost per training step and per ``trainer.fit``, on a model whose compute is negligible.

A ``Linear(4, 2)`` trained with SGD on batches of 32 in memory, the same steps once as a plain PyTorch loop and once
through the Federation's path to Lightning (a Trainer with the CLI's defaults and no logger, driven by
:class:`fl_lightning.local_fit.LocalFitter`), alternating, in one process. With the model's compute near zero, what
is left of the difference is Lightning's dispatch (hooks, the optimisation closure, ``LightningOptimizer``, loop
bookkeeping): a floor under the per-step overhead of any client fit on this machine. Short fits of a few steps (one
per client, as the Federation runs them) add Lightning's fixed set-up and teardown per fit, measured here too.

    python benchmarks/lightning_step.py [--steps 500] [--fit-steps 5] [--repeats 3]
"""

# ruff: noqa: E402 (the imports of the repository follow the sys.path set-up)
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.local_fit import LocalFitter

BATCH = 32


class Tiny(L.LightningModule):
    """``Linear(4, 2)`` with cross-entropy: the smallest step Lightning can run."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(steps: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH, 4, generator=generator)
    y = torch.randint(0, 2, (steps * BATCH,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def plain_fit(data: DataLoader) -> float:
    """Seconds for one pass of plain SGD (new optimiser, like a client fit)."""
    start = time.perf_counter()
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return time.perf_counter() - start


def lightning_fits(data: DataLoader, fits: int) -> tuple[float, int]:
    """``fits`` consecutive one-pass fits on ONE Trainer, run as the Federation runs a client's.

    Returns:
        The seconds they took and the training steps they ran (every fit must run its pass: a Trainer whose
        epoch budget was not raised would return at once, and the benchmark would time nothing).

    """
    fitter = LocalFitter(L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False}))
    module = Tiny()
    start = time.perf_counter()
    steps = sum(fitter.fit(module, data, epochs=1, client_id="tiny")[0] for _ in range(fits))
    return time.perf_counter() - start, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="steps of the one long fit")
    parser.add_argument("--fit-steps", type=int, default=5, help="steps of each short fit (W1: ≈ 5 per client)")
    parser.add_argument("--fits", type=int, default=100, help="short fits per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="alternate both paths this many times; report medians")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's "few workers" and "fit stopped" notices
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    long_data, short_data = loader(args.steps), loader(args.fit_steps)
    lightning_fits(short_data, 2)  # warm-up: first-call costs of both paths
    plain_fit(short_data)
    per_step, per_fit = [], []
    for _ in range(args.repeats):
        plain_long = plain_fit(long_data)
        seconds, _ = lightning_fits(long_data, 1)
        per_step.append((seconds - plain_long) / args.steps)
        plain_short = sum(plain_fit(short_data) for _ in range(args.fits))
        seconds, _ = lightning_fits(short_data, args.fits)
        per_fit.append((seconds - plain_short) / args.fits)
    step_ms, fit_ms = 1e3 * statistics.median(per_step), 1e3 * statistics.median(per_fit)
    print(f"Lightning {L.__version__}, torch {torch.__version__}, 1 thread, medians of {args.repeats}")
    print(f"per step, one fit of {args.steps} steps:        {step_ms:6.3f} ms beyond the plain loop")
    print(f"per fit of {args.fit_steps} steps on one Trainer:       {fit_ms:6.3f} ms beyond the plain loop")
    print(f"  of which fixed per fit (set-up, teardown): {fit_ms - args.fit_steps * step_ms:6.3f} ms")


if __name__ == "__main__":
    main()
