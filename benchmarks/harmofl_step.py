"""Cost of one HarmoFL client step relative to one FedAvg step on the same batch (target: at most 2.3x).

A HarmoFL step is amplitude normalisation (FFT, amplitude swap, inverse FFT) plus the sharpness-aware
step (a second forward/backward pass at w + δ); a FedAvg step is one forward/backward pass. Both run
through a Lightning Trainer with the CLI's Trainer defaults (automatic optimisation), on one fixed batch
repeated, in one process, alternating FedAvg and HarmoFL fits ``--repeats`` times. The time of a step is
``on_train_batch_start`` → ``on_train_batch_end``, in wall-clock time and in CPU time of the (single)
training thread, which other processes on a shared machine barely disturb. Per variant the script takes
the best (lowest) of the repeats' median step times, and prints the ratios for both embedded tasks at
their config sizes (digits 16 px SmallCNN width 32 batch 32; digit segmentation 24 px UNet width 8
batch 16), with the amplitude both running (round 1) and frozen (later rounds).

    python benchmarks/harmofl_step.py [--steps 20] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import WeightPerturbation
from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.clients import ClassificationClient, SegmentationClient
from fl_lightning.models.amplitude_norm import AmplitudeNorm


class StepTimer(L.Callback):
    """Wall time and this thread's CPU time of every training step."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._t0 = self._c0 = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def on_train_batch_end(self, *args: Any) -> None:
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.thread_time() - self._c0)


def task_batch(task: str) -> tuple[L.LightningModule, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    if task == "digits":
        model = ClassificationClient(num_classes=10, in_channels=1, image_size=(16, 16), width=32, lr=0.05)
        return model, (torch.rand(32, 1, 16, 16), torch.randint(0, 10, (32,)))
    model = SegmentationClient(num_classes=5, in_channels=1, image_size=(24, 24), width=8, depth=2, lr=3e-3)
    return model, (torch.rand(16, 1, 24, 24), torch.randint(0, 5, (16, 24, 24)))


def time_steps(module: L.LightningModule, batch: tuple, steps: int, callbacks: list[L.Callback]) -> tuple[float, float]:
    """Median wall and CPU seconds per training step over ``steps`` steps (the first two are warm-up)."""
    x, y = batch
    loader = DataLoader(TensorDataset(x.repeat(steps, *[1] * (x.ndim - 1)), y.repeat(steps, *[1] * (y.ndim - 1))),
                        batch_size=len(x), shuffle=False)  # fmt: skip
    timer = StepTimer()
    trainer = L.Trainer(
        **{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False, "max_epochs": 1, "callbacks": [*callbacks, timer]}
    )
    trainer.fit(module, loader)
    return statistics.median(timer.wall[2:]), statistics.median(timer.cpu[2:])


def harmofl_module(template: L.LightningModule, batch: tuple, frozen: bool) -> L.LightningModule:
    module = copy.deepcopy(template)
    x = batch[0]
    layer = AmplitudeNorm(x.shape[1], tuple(x.shape[2:]), v=0.1, band=1.0)
    layer.train()(x)  # a first statistic, as after the first batch of round 1
    layer.frozen.fill_(frozen)
    module.input_norm = layer
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"time per client step (best of the repeats' medians), {args.steps} steps x {args.repeats} repeats, "
          f"{args.threads} torch thread(s); wall clock, and in brackets this thread's CPU time")  # fmt: skip
    print(f"{'task':11s} {'FedAvg':>17s} {'HarmoFL r1':>17s} {'HarmoFL':>17s} {'ratio r1':>13s} {'ratio':>13s}")
    for task in ("digits", "digits_seg"):
        template, batch = task_batch(task)
        runs: dict[str, list[tuple[float, float]]] = {"fedavg": [], "round1": [], "frozen": []}
        for _ in range(args.repeats):
            runs["fedavg"].append(time_steps(copy.deepcopy(template), batch, args.steps, []))
            for name, frozen in (("round1", False), ("frozen", True)):
                module = harmofl_module(template, batch, frozen)
                runs[name].append(time_steps(module, batch, args.steps, [WeightPerturbation(alpha=0.05)]))
        wall = {k: min(w for w, _ in v) for k, v in runs.items()}
        cpu = {k: min(c for _, c in v) for k, v in runs.items()}
        cells = [f"{wall[k] * 1e3:6.2f} ({cpu[k] * 1e3:6.2f}) ms" for k in runs]
        ratios = [f"{wall[k] / wall['fedavg']:5.2f} ({cpu[k] / cpu['fedavg']:4.2f})" for k in ("round1", "frozen")]
        print(f"{task:11s} {' '.join(cells)} {' '.join(f'{r:>13s}' for r in ratios)}  (target <= 2.3x)")


if __name__ == "__main__":
    main()
