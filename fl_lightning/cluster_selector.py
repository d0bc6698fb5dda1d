"""The cluster selector of sample-clustered FL: a small CNN of cluster ids, trained federatedly with SCAFFOLD.

It reuses the project's own Federation, ClassificationClient and Scaffold callback on an in-memory
datamodule of (image, cluster id) per client, in a sub-run directory ``selector/`` of the main run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning as L
import torch
from torch import Tensor, nn

from datamodules.base import ClientSplit, FederatedDataModule
from fl_lightning.clients.classification import ClassificationClient
from fl_lightning.config import FederationConfig

if TYPE_CHECKING:
    from fl_lightning.federation import Federation


class ClusterIdData(FederatedDataModule):
    """Given per-client splits in memory (images with cluster ids as labels).

    Args:
        splits: The clients' data.
        num_classes: Number of clusters.
        batch_size: Training batch size.
        seed: Seed of the per-client shuffling.
    """

    def __init__(self, splits: list[ClientSplit], num_classes: int, batch_size: int, seed: int) -> None:
        super().__init__(batch_size=batch_size, seed=seed)
        self._given = splits
        self._declared_num_classes = num_classes
        self._source = "cluster selector"

    def _load(self) -> list[ClientSplit]:
        return self._given


def build_selector(federation: Federation, n_clusters: int, width: int, lr: float = 0.005, weight_decay: float = 1e-3):
    """A fresh selector CNN for the federation's images (plain SGD without momentum, as SCAFFOLD needs)."""
    data = federation.data
    return ClassificationClient(
        num_classes=n_clusters,
        in_channels=data.in_channels,
        image_size=data.image_size,
        arch="cnn",
        width=width,
        optimizer="sgd",
        lr=lr,
        momentum=0.0,
        weight_decay=weight_decay,
    )


def train_selector(
    federation: Federation,
    clusters: dict[str, Tensor],
    oracle: dict[int, int],
    n_clusters: int,
    seed: int,
    rounds: int,
    local_steps: int,
    lr: float,
    weight_decay: float,
    width: int,
) -> ClassificationClient:
    """Train the selector with SCAFFOLD on every client's (training image, cluster id).

    Its test sets are the clients' test images labelled with their oracle cluster when the domains are
    known (so ``selector/summary.json`` reports routing accuracy), else their training images.

    Args:
        federation: The main federation (its data, device, run directory and seed).
        clusters: Per client, the cluster id of each training sample.
        oracle: True domain → cluster (empty when the domains are unknown).
        n_clusters: Number of clusters.
        seed: Seed of the selector's initialisation and shuffling.
        rounds: Federated rounds.
        local_steps: Local SGD steps per round.
        lr: Learning rate.
        weight_decay: Weight decay.
        width: CNN channels.

    Returns:
        The trained selector (on the CPU).
    """
    from callbacks.scaffold import Scaffold  # callbacks import this module's users; keep the import local
    from fl_lightning.cli import TRAINER_DEFAULTS
    from fl_lightning.federation import Federation

    splits = []
    for cid, labels in clusters.items():
        split = federation.data.client_data(cid)
        if oracle and split.test_domain is not None:
            test_x, test_y = split.test_x, torch.tensor([oracle.get(int(d), 0) for d in split.test_domain])
        else:
            test_x, test_y = split.train_x, labels
        splits.append(ClientSplit(cid, split.train_x, labels.clone(), test_x, test_y.to(torch.int64)))
    data = ClusterIdData(splits, n_clusters, federation.data.batch_size, seed)
    # A private RNG stream: the selector's initialisation must not depend on (or disturb) the main run's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build_selector(federation, n_clusters, width, lr, weight_decay)
        accelerator = "gpu" if federation.device.type == "cuda" else "cpu"
        trainer_args = {**TRAINER_DEFAULTS, "accelerator": accelerator, "devices": 1, "logger": False}
        trainer = L.Trainer(**trainer_args, callbacks=[Scaffold()])
        cfg = FederationConfig(
            rounds=rounds,
            local_steps=local_steps,
            eval_every=0,
            output_dir=str(federation.run_dir.path),
            run_name="selector",
            progress=False,
            plots=False,
            checkpoint_every=0,
        )
        Federation(cfg, module, data, trainer, seed=seed).run()
    return module.cpu()


@torch.inference_mode()
def predict_clusters(selector: nn.Module, images: Tensor, device: torch.device, batch_size: int = 256) -> Tensor:
    """The selector's predicted cluster id of every image (int64, CPU)."""
    was_training = selector.training
    selector.eval().to(device)
    preds = [selector(images[i : i + batch_size].to(device)).argmax(1).cpu() for i in range(0, len(images), batch_size)]
    selector.train(was_training)
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.int64)
