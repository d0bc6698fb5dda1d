"""DP-SGD's cost per step against the plain step on the digits CNN with GroupNorm (Opacus, as callbacks.DPSGD runs it).

Both loops train the same SmallCNN (``configs/dpsgd_digits.yaml``'s model: width 32, GroupNorm, 16 px, 10 classes)
on batches of the embedded digits with SGD. The DP step is Opacus' own machinery as ``callbacks.DPSGD`` attaches
it to the client's module: ``GradSampleHooks`` (per-example gradients captured in the backward pass) and a
``DPOptimizer`` (per-example clipping to C, summing, Gaussian noise, division by the batch size). The time of a DP
step is split where it goes:

- ``forward+backward``: the pass with the per-example hooks (each layer's activations kept and, in the backward,
  one gradient per example: ``grad_sample``);
- ``clip+noise``: ``DPOptimizer.pre_step`` (per-example norms, clipping, summing, one noise draw per parameter);
- ``update``: the SGD update itself.

It prints the medians of ``--repeats`` timed runs of ``--steps`` steps (after a warm-up) and the ratios against the
plain step measured in the same run.

    python benchmarks/dp_sgd.py [--batch 32] [--steps 50] [--repeats 5] [--threads 2] [--width 32] [--size 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from opacus.grad_sample import GradSampleHooks
from opacus.optimizers import DPOptimizer
from torch import nn

from datamodules import DigitsFederated
from fl_lightning.models.registry import build_classifier


def batches(batch: int, size: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of site0's training digits (cycled)."""
    data = DigitsFederated(num_clients=1, image_size=size, site_styles=False, seed=0)
    data.setup()
    x, y = data.client_data("site0").train_x, data.client_data("site0").train_y
    out = []
    for i in range(count):
        idx = torch.arange(i * batch, (i + 1) * batch) % len(x)
        out.append((x[idx], y[idx]))
    return out


def model(width: int, size: int) -> nn.Module:
    torch.manual_seed(0)
    net = build_classifier("cnn", 1, 10, (size, size), width=width, norm="group")
    for m in net.modules():  # Opacus' full backward hooks refuse in-place activations (callbacks.DPSGD does this too)
        if isinstance(m, nn.ReLU):
            m.inplace = False
    return net


def plain_steps(net: nn.Module, data: list, lr: float) -> dict[str, float]:
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    t0 = time.perf_counter()
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return {"step": (time.perf_counter() - t0) / len(data)}


def dp_steps(net: nn.Module, data: list, lr: float, batch: int) -> dict[str, float]:
    hooks = GradSampleHooks(net)
    opt = DPOptimizer(
        torch.optim.SGD(net.parameters(), lr=lr),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch,
        generator=torch.Generator().manual_seed(0),
    )
    spans = {"forward+backward": 0.0, "clip+noise": 0.0, "update": 0.0}
    try:
        for x, y in data:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x), y).backward()
            t1 = time.perf_counter()
            opt.pre_step()  # clip, sum, noise (what opt.step() does first)
            t2 = time.perf_counter()
            opt.original_optimizer.step()
            t3 = time.perf_counter()
            spans["forward+backward"] += t1 - t0
            spans["clip+noise"] += t2 - t1
            spans["update"] += t3 - t2
    finally:
        hooks.cleanup()
    out = {k: v / len(data) for k, v in spans.items()}
    out["step"] = sum(out.values())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--size", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = batches(args.batch, args.size, args.steps)
    plain_steps(model(args.width, args.size), data[:5], 0.05)  # warm-up
    dp_steps(model(args.width, args.size), data[:5], 0.05, args.batch)
    plain, dp = [], []
    for _ in range(args.repeats):  # interleaved, so a slow moment of the machine hits both
        plain.append(plain_steps(model(args.width, args.size), data, 0.05))
        dp.append(dp_steps(model(args.width, args.size), data, 0.05, args.batch))
    base = statistics.median(r["step"] for r in plain)
    print(f"SmallCNN width {args.width}, GroupNorm, {args.size} px, batch {args.batch}, {args.threads} threads, "
          f"median of {args.repeats} runs of {args.steps} steps")  # fmt: skip
    print(f"  plain step            {base * 1e3:8.2f} ms")
    for key in ("forward+backward", "clip+noise", "update", "step"):
        value = statistics.median(r[key] for r in dp)
        print(f"  DP-SGD {key:<15}{value * 1e3:8.2f} ms   {value / base:5.2f}x the plain step")


if __name__ == "__main__":
    main()
