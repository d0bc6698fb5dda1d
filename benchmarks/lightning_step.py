"""Lightning's own cost per training step and per ``trainer.fit``, beyond a plain loop doing the same steps.

The same steps run once as a plain PyTorch loop and once through the Federation's path to Lightning (a Trainer with
the CLI's defaults and no logger, driven by :class:`fl_lightning.runtime.local_fit.LocalFitter`), alternating, in one
process: one long fit (the per-step cost), many short fits of a few steps on the one Trainer, as the Federation
runs a client's with ``federation.round_fit=false`` (the fixed set-up and teardown per fit), and as many clients of
a few steps each in one round fit with Lightning's loop per step (``federation.client_loop=false``: the fixed cost per
client left is the client switch at Lightning's epoch boundary, a fresh optimiser, the ``on_train_start``/
``on_train_end`` hooks), and the same clients in one round fit whose clients each run their steps inside one Lightning
step (the client loop, the default: manual optimisation, Lightning's per-batch dispatch once per client). Two
workloads:

- ``tiny``: a ``Linear(4, 2)`` on batches of 32 in memory, whose compute is negligible: what is left is Lightning's
  dispatch (hooks, the optimisation closure, ``LightningOptimizer``, loop bookkeeping), a floor under the per-step
  overhead of any client fit on this machine;
- ``w1``: the shared benchmark's W1 step (``../shared/bench``: the digits at 32 px, SmallCNN without norm layers,
  SGD lr 0.05 without momentum, batch 32, a client's own loader; run it with ``--threads 2`` as W1 does): the
  per-step cost that any way of grouping client fits (one ``trainer.fit`` per client or one per round) would keep.

    python benchmarks/lightning_step.py [--workload tiny|w1] [--steps 500] [--fit-steps 5] [--threads 1]
"""

# ruff: noqa: E402 (the imports of the repository follow the sys.path set-up)
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # runs from a checkout, installed or not

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.clients.base import ClientModule
from fl_lightning.runtime.local_fit import LocalFitter
from fl_lightning.runtime.round_fit import ClientFit, RoundFit
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import Reply, Task

BATCH = 32


class Workload(NamedTuple):
    """What both paths train: the module (its ``net`` for the plain loop), its loaders, the SGD learning rate."""

    module: L.LightningModule
    loader: Callable[[int], DataLoader]  # a loader of exactly ``steps`` batches
    lr: float


class Tiny(ClientModule):
    """``Linear(4, 2)`` with cross-entropy: the smallest step Lightning can run."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def evaluate(self, batches: Any, device: torch.device) -> dict[str, float]:
        return {}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(steps: int) -> DataLoader:
    """``steps`` batches of the tiny workload."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH, 4, generator=generator)
    y = torch.randint(0, 2, (steps * BATCH,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def tiny_workload() -> Workload:
    """``Tiny`` on random batches."""
    return Workload(Tiny(), loader, 0.1)


def w1_workload() -> Workload:
    """W1's client module and its first client's loader (of any number of steps)."""
    import overhead  # the digits workload of the overhead benchmark, here with W1's settings

    args = overhead.workload_parser(__doc__, 1, "").parse_args(overhead.W1_FLAGS)
    data = overhead.make_data(args)
    client = data.client_ids[0]
    module = overhead.make_model(data, args)
    return Workload(module, lambda steps: data.client_train_loader(client, steps=steps), module.hparams.lr)


WORKLOADS: dict[str, Callable[[], Workload]] = {"tiny": tiny_workload, "w1": w1_workload}


def plain_fit(net: torch.nn.Module, lr: float, data: DataLoader) -> float:
    """Seconds for one pass of plain SGD over ``data`` (a new optimiser, like a client fit)."""
    start = time.perf_counter()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return time.perf_counter() - start


def lightning_fits(module: L.LightningModule, data: DataLoader, fits: int) -> tuple[float, int]:
    """``fits`` consecutive one-pass fits of ``module`` on ONE Trainer, run as the Federation runs a client's.

    Returns:
        The seconds they took and the training steps they ran (every fit must run its pass: a Trainer whose
        epoch budget was not raised would return at once, and the benchmark would time nothing).

    """
    fitter = LocalFitter(L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False}))
    start = time.perf_counter()
    steps = sum(fitter.fit(module, data, epochs=1, client_id="bench")[0] for _ in range(fits))
    return time.perf_counter() - start, steps


def lightning_round_fit(
    module: L.LightningModule, data: DataLoader, clients: int, client_loop: bool
) -> tuple[float, int]:
    """``clients`` one-pass clients of ``module`` in ONE round fit on one Trainer, as the runtime runs a round's."""
    fitter = LocalFitter(L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False}))
    steps = []

    def begin(task: Task) -> ClientFit:
        return ClientFit(task, [], data, 1, None)

    def finish(fit: ClientFit, ran: int, _: object) -> Reply:
        steps.append(ran)
        return Reply(fit.task.client_id)

    def fail(fit: ClientFit, err: Exception) -> Reply:
        raise err

    tasks = [Task(protocol.FIT, 0, f"client{i}") for i in range(clients)]
    start = time.perf_counter()
    RoundFit(fitter, module, tasks, begin, finish, fail, lambda fit: None, False, client_loop).run()
    return time.perf_counter() - start, sum(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=list(WORKLOADS), default="tiny", help="the step both paths run")
    parser.add_argument("--steps", type=int, default=500, help="steps of the one long fit")
    parser.add_argument("--fit-steps", type=int, default=5, help="steps of each short fit (W1: ≈ 5 per client)")
    parser.add_argument("--fits", type=int, default=100, help="short fits per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="alternate both paths this many times; report medians")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (W1 runs with 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Lightning's "few workers" and "fit stopped" notices
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    module, loaders, lr = WORKLOADS[args.workload]()
    long_data, short_data = loaders(args.steps), loaders(args.fit_steps)
    lightning_fits(module, short_data, 2)  # warm-up: first-call costs of both paths
    plain_fit(module.net, lr, short_data)
    lightning_round_fit(module, short_data, 2, False)
    lightning_round_fit(module, short_data, 2, True)
    per_step, per_fit, per_client, per_loop_client, plain_steps = [], [], [], [], []
    for _ in range(args.repeats):
        plain_long = plain_fit(module.net, lr, long_data)
        seconds, _ = lightning_fits(module, long_data, 1)
        plain_steps.append(plain_long / args.steps)
        per_step.append((seconds - plain_long) / args.steps)
        plain_short = sum(plain_fit(module.net, lr, short_data) for _ in range(args.fits))
        seconds, _ = lightning_fits(module, short_data, args.fits)
        per_fit.append((seconds - plain_short) / args.fits)
        seconds, _ = lightning_round_fit(module, short_data, args.fits, False)
        per_client.append((seconds - plain_short) / args.fits)
        seconds, steps = lightning_round_fit(module, short_data, args.fits, True)
        assert steps == args.fits * args.fit_steps, steps
        per_loop_client.append((seconds - plain_short) / args.fits)
    step_ms, fit_ms = 1e3 * statistics.median(per_step), 1e3 * statistics.median(per_fit)
    client_ms = 1e3 * statistics.median(per_client)
    loop_ms = 1e3 * statistics.median(per_loop_client)
    plain_ms = 1e3 * statistics.median(plain_steps)
    print(
        f"{args.workload}: Lightning {L.__version__}, torch {torch.__version__}, {args.threads} thread(s), "
        f"medians of {args.repeats} (min–max)"
    )
    print(f"plain step:                                  {plain_ms:6.3f} ms {spread(plain_steps)}")
    print(
        f"per step, one fit of {args.steps} steps:        {step_ms:6.3f} ms {spread(per_step)} beyond the plain "
        f"loop ({100 * step_ms / plain_ms:.1f} % of its step)"
    )
    print(
        f"per fit of {args.fit_steps} steps on one Trainer:       {fit_ms:6.3f} ms {spread(per_fit)} beyond the "
        "plain loop"
    )
    print(f"  of which fixed per fit (set-up, teardown): {fit_ms - args.fit_steps * step_ms:6.3f} ms")
    print(
        f"per client of {args.fit_steps} steps in one round fit, Lightning's loop per step: {client_ms:6.3f} ms "
        f"{spread(per_client)} beyond the plain loop"
    )
    print(f"  of which fixed per client (the switch):    {client_ms - args.fit_steps * step_ms:6.3f} ms")
    print(
        f"per client of {args.fit_steps} steps in one round fit, client loop:           {loop_ms:6.3f} ms "
        f"{spread(per_loop_client)} beyond the plain loop ({loop_ms / args.fit_steps:.3f} ms per step)"
    )


def spread(seconds: list[float]) -> str:
    """``(min–max)`` of a list of seconds, in milliseconds: this shared machine's timings vary from repeat to repeat."""
    return f"({1e3 * min(seconds):.3f}–{1e3 * max(seconds):.3f})"


if __name__ == "__main__":
    main()
