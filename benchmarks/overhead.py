"""Overhead of the Federation over a plain PyTorch loop doing the identical FedAvg work.

Workload (issue "Federated core"): embedded digits, 10 clients, Dirichlet α=0.5, SmallCNN, batch 32,
1 local epoch, 20 rounds, every client every round, evaluation of the global model at the end.
Both runs start from the same weights and draw the same batches (the datamodule's seeded samplers),
so their final weights agree to float rounding; the script prints both wall times, their ratio and
both final accuracies.

    python benchmarks/overhead.py [--rounds 20] [--image-size 16] [--repeats 2] [--device cpu]
"""

# ruff: noqa: E402 (the imports of the repository follow the sys.path set-up)
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

import lightning as L
import torch
import torch.nn.functional as F

from datamodules import DigitsFederated
from fl_lightning import ClassificationClient, FederationConfig, local_federation
from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.clients.metrics import classification_metrics
from fl_lightning.ops import RunningWeightedMean, aggregation_weights


def make_data(args: argparse.Namespace) -> DigitsFederated:
    return DigitsFederated(
        num_clients=10, partition="dirichlet", alpha=0.5, image_size=args.image_size, batch_size=32, seed=0
    )


def make_model(data: DigitsFederated, args: argparse.Namespace) -> ClassificationClient:
    torch.manual_seed(0)
    return ClassificationClient(
        num_classes=data.num_classes,
        in_channels=data.in_channels,
        image_size=data.image_size,
        width=args.width,
        norm=args.norm,
        lr=0.05,
        momentum=args.momentum,
    )


def run_federation(args: argparse.Namespace) -> tuple[float, float, dict[str, torch.Tensor]]:
    data = make_data(args)
    model = make_model(data, args)
    trainer = L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": args.device, "logger": False})
    with tempfile.TemporaryDirectory() as out:
        cfg = FederationConfig(
            rounds=args.rounds, eval_every=0, output_dir=out, progress=False, plots=False
        )  # fmt: skip
        fed = local_federation(cfg, model, data, trainer, seed=0)
        start = time.perf_counter()
        summary = fed.run()
        seconds = time.perf_counter() - start
    return seconds, summary["pooled"]["acc"], fed.groups[0].state


@torch.inference_mode()
def evaluate(
    net: torch.nn.Module, loader: torch.utils.data.DataLoader, num_classes: int, device: str = "cpu"
) -> dict[str, float]:
    net.eval()
    logits, targets = zip(*[(net(x.to(device)).cpu(), y) for x, y in loader])
    net.train()
    return classification_metrics(torch.cat(logits), torch.cat(targets), num_classes)


def run_plain(
    args: argparse.Namespace, span: Callable[[str], AbstractContextManager[object]] = lambda _: nullcontext()
) -> tuple[float, float, dict[str, torch.Tensor]]:
    """FedAvg written directly in PyTorch: the lower bound on the time of the same work.

    ``span(part)`` wraps each part of the work (``setup``, ``steps``, ``own``, ``evaluation``) for
    a caller's timings; by default it does nothing.
    """
    data = make_data(args)
    net = make_model(data, args).net.to(args.device)
    ids = data.client_ids
    start = time.perf_counter()
    global_state = copy.deepcopy(net.state_dict())
    weights = aggregation_weights([data.num_train_samples(c) for c in ids])
    for _ in range(args.rounds):
        mean = RunningWeightedMean()
        for cid, weight in zip(ids, weights):
            with span("setup"):
                net.load_state_dict(global_state)
                net.train()
                opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=args.momentum)
            with span("steps"):
                for x, y in data.client_train_loader(cid):
                    x, y = x.to(args.device), y.to(args.device)
                    opt.zero_grad()
                    F.cross_entropy(net(x), y).backward()
                    opt.step()
            with span("own"):
                mean.add(net.state_dict(), weight)
        global_state = mean.result()
    net.load_state_dict(global_state)
    with span("evaluation"):
        for cid in ids:  # the Federation evaluates every client's test set too
            evaluate(net, data.client_test_loader(cid), data.num_classes, args.device)
        acc = evaluate(net, data.pooled_test_loader(), data.num_classes, args.device)["acc"]
    return time.perf_counter() - start, acc, {f"net.{k}": v.cpu() for k, v in global_state.items()}


#: W1's model and optimiser (../shared/bench/fl_w1.yaml) in this workload's flags; W1 also runs ``--threads 2``.
W1_FLAGS = ("--image-size", "32", "--norm", "none", "--momentum", "0")


def workload_parser(doc: str, repeats: int, repeats_help: str) -> argparse.ArgumentParser:
    """The command line of this workload."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--norm", default="batch", choices=["batch", "none"], help="SmallCNN's norm layers")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (both runs)")
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 gives the steadiest timings)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both runs train")
    return parser


def main() -> None:
    args = workload_parser(__doc__, 3, "alternate both runs this many times; report the best").parse_args()
    torch.set_num_threads(args.threads)
    fed_times, plain_times = [], []
    for _ in range(args.repeats):
        t_plain, acc_plain, w_plain = run_plain(args)
        t_fed, acc_fed, w_fed = run_federation(args)
        plain_times.append(t_plain)
        fed_times.append(t_fed)
    diff = max((w_fed[k].double() - w_plain[k].double()).abs().max().item() for k in w_plain)
    print(
        f"workload: digits {args.image_size}px, 10 clients, Dirichlet 0.5, {args.rounds} rounds, 1 local epoch, "
        f"{args.threads} thread(s)"
    )
    print(f"all runs (s): plain {[round(t, 2) for t in plain_times]}  federation {[round(t, 2) for t in fed_times]}")
    print(f"plain PyTorch loop : {min(plain_times):7.2f} s   pooled test acc {acc_plain:.4f}")
    print(f"Federation         : {min(fed_times):7.2f} s   pooled test acc {acc_fed:.4f}")
    print(f"ratio (best of {args.repeats})  : {min(fed_times) / min(plain_times):7.3f}   (target <= 1.15)")
    print(f"accuracy gap       : {abs(acc_fed - acc_plain) * 100:7.2f} points (target <= 1)")
    print(f"max |weight diff|  : {diff:.2e}")


if __name__ == "__main__":
    main()
