"""The medical-size benchmark's work as a plain PyTorch loop: the lower bound on its time.

Reads the same train.py config (``benchmarks/medical_unet.yaml``) and does what ``python train.py --config``
does with it for FedAvg, without Lightning's Trainer or the Federation:

* seeds as LightningCLI does (``seed_everything(seed_everything)``), then instantiates the datamodule and the
  ``SegmentationClient`` in LightningCLI's order (data first; its ``num_classes``, ``in_channels`` and
  ``image_size`` go into the model), so the initial weights are the same; only the client's ``.net`` is used
  (``SegmentationClient.forward`` applies ``input_norm`` first, an identity unless a method installs a layer);
* every round, each client in turn loads the global weights, builds a fresh Adam (as train.py does without
  ``federation.keep_optimizer_state``) and trains ``local_epochs`` passes over ``data.client_train_loader(cid)``
  (the datamodule's seeded samplers: the same batches as train.py) on cross-entropy + ``dice_weight`` x soft Dice;
* the server takes the sample-weighted mean of the client state dicts (floats in float32, integer buffers such
  as BatchNorm's ``num_batches_tracked`` in float64 and rounded back, as ``fl_lightning.ops.RunningWeightedMean``);
* every ``eval_every`` rounds (and after the last) the global model on every client's test loader, with the
  metrics train.py computes there (foreground Dice, mIoU, the test loss, HD95, surface Dice): the client
  module's own plain-PyTorch evaluation (``SegmentationClient.evaluation_parts`` and ``metrics_from_parts``, no
  Trainer), so the two do the same evaluation work; the pooled metrics from the merged counts.

It prints each evaluated round's Dice and, last, ``RESULT_JSON {...}`` with the final mean Dice over clients
(``final_dice``, train.py's ``summary.global.dice.mean``), the pooled Dice and in-script timings.

    python benchmarks/medical_raw.py --config benchmarks/medical_unet.yaml [--rounds 5] [--image-size 128]
                                     [--local-epochs 2]
"""

# ruff: noqa: E402 (the imports of the repository follow the sys.path set-up)
from __future__ import annotations

import time

START = time.perf_counter()  # before the heavy imports: the in-script total includes them

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

# The repository's modules first, as a script using them would: importing fl_lightning before Lightning lets
# Lightning's import of torchmetrics skip scipy.signal (fl_lightning/startup/lean_imports.py), as in train.py.
# train.py also keeps the cyclic collector off while it imports (startup/heap.py); this plain loop does not.
from fl_lightning.clients.segmentation_metrics import soft_dice_loss  # isort: skip
from datamodules.base import FederatedDataModule  # isort: skip
from fl_lightning.ops import RunningWeightedMean, aggregation_weights  # isort: skip

import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch import seed_everything
from torch import nn

IMPORT_S = time.perf_counter() - START


def parse_args() -> argparse.Namespace:
    """The config file and the overrides the driver forwards (None: the config's value)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="benchmarks/medical_unet.yaml", help="a train.py config")
    parser.add_argument("--rounds", type=int, default=None, help="overrides federation.rounds")
    parser.add_argument("--image-size", type=int, default=None, help="overrides data.init_args.image_size")
    parser.add_argument("--local-epochs", type=int, default=None, help="overrides federation.local_epochs")
    parser.add_argument("--device", default="cpu", help="where to train and evaluate (cpu, cuda)")
    return parser.parse_args()


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    """The YAML with the command line's overrides applied."""
    config = yaml.safe_load(Path(args.config).read_text())
    if args.rounds is not None:
        config["federation"]["rounds"] = args.rounds
    if args.local_epochs is not None:
        config["federation"]["local_epochs"] = args.local_epochs
    if args.image_size is not None:
        config["data"]["init_args"]["image_size"] = args.image_size
    return config


def instantiate(spec: dict[str, Any], **extra: Any) -> Any:
    """``class_path`` + ``init_args`` (+ ``extra``) as jsonargparse instantiates them."""
    module_name, _, class_name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**{**spec.get("init_args", {}), **extra})


def build(config: dict[str, Any]) -> tuple[FederatedDataModule, Any, float]:
    """Seed, then data, then the model (LightningCLI's order); the datamodule, the client module, the dice weight."""
    seed_everything(int(config.get("seed_everything", 0)))
    data: FederatedDataModule = instantiate(config["data"])
    data.setup("fit")
    linked = {"num_classes": data.num_classes, "in_channels": data.in_channels, "image_size": data.image_size}
    client = instantiate(config["model"], **linked)
    # SegmentationClient.forward is net(input_norm(x)); input_norm is nn.Identity for plain FedAvg.
    assert isinstance(client.input_norm, nn.Identity), "this loop mirrors plain FedAvg only"
    return data, client, float(client.hparams.dice_weight)


def train_client(
    net: nn.Module, loader: torch.utils.data.DataLoader, epochs: int, lr: float, dice_weight: float, device: str
) -> None:
    """``epochs`` passes of Adam on CE + ``dice_weight`` x soft Dice (foreground)."""
    net.train()
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            logits = net(x)
            loss = F.cross_entropy(logits, y)
            if dice_weight:
                loss = loss + dice_weight * soft_dice_loss(logits, y)
            loss.backward()
            opt.step()


def evaluate(client: Any, data: FederatedDataModule, device: torch.device) -> dict[str, Any]:
    """The global model's metrics on every client's test set (foreground Dice per client, their mean) and pooled."""
    parts = {cid: client.evaluation_parts(data.client_test_loader(cid), device) for cid in data.client_ids}
    per_client = {cid: client.metrics_from_parts(p)["dice"] for cid, p in parts.items()}
    pooled = client.metrics_from_parts(client.merge_parts(list(parts.values())))["dice"]
    return {"mean": sum(per_client.values()) / len(per_client), "pooled": pooled, "clients": per_client}


def run(config: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """FedAvg over every client for ``federation.rounds`` rounds; the per-round Dice and timings."""
    fed, lr = config["federation"], float(config["model"]["init_args"]["lr"])
    assert fed.get("aggregation", "samples") == "samples" and fed.get("client_fraction", 1.0) == 1.0
    t0 = time.perf_counter()
    data, client, dice_weight = build(config)
    net = client.to(device).net
    setup_s = time.perf_counter() - t0
    ids = data.client_ids
    sizes = [data.num_train_samples(c) for c in ids]
    weights = aggregation_weights(sizes)
    global_state = {k: v.clone() for k, v in net.state_dict().items()}
    rounds, eval_every = int(fed["rounds"]), int(fed.get("eval_every", 1))
    round_s, round_dice, evaluation = [], [], {}
    for r in range(rounds):
        t_round = time.perf_counter()
        mean = RunningWeightedMean()  # the sample-weighted mean train.py's FedAvg takes (floats and integer buffers)
        for cid, weight in zip(ids, weights):
            net.load_state_dict(global_state)
            train_client(net, data.client_train_loader(cid), int(fed["local_epochs"]), lr, dice_weight, device)
            mean.add(net.state_dict(), weight)
        global_state = mean.result()
        if r + 1 == rounds or (eval_every and (r + 1) % eval_every == 0):
            net.load_state_dict(global_state)
            evaluation = evaluate(client, data, torch.device(device))
            round_dice.append(evaluation["mean"])
            per_client = " ".join(f"{c} {d:.4f}" for c, d in evaluation["clients"].items())
            print(f"round {r + 1}/{rounds}  dice {evaluation['mean']:.4f}  pooled {evaluation['pooled']:.4f}  "
                  f"({per_client})", flush=True)  # fmt: skip
        round_s.append(time.perf_counter() - t_round)
    return {
        "final_dice": evaluation["mean"],
        "final_pooled_dice": evaluation["pooled"],
        "client_dice": evaluation["clients"],
        "round_dice": round_dice,
        "round_s": round_s,
        "rounds_s": sum(round_s),
        "setup_s": setup_s,
        "client_sizes": sizes,
    }


def main() -> None:
    args = parse_args()
    result = run(load_config(args), args.device)
    result["import_s"] = IMPORT_S
    result["script_s"] = time.perf_counter() - START
    print(f"final mean dice {result['final_dice']:.4f}  pooled {result['final_pooled_dice']:.4f}  "
          f"rounds {result['rounds_s']:.2f}s  in-script {result['script_s']:.2f}s")  # fmt: skip
    print("RESULT_JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
