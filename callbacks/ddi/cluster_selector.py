"""The cluster selector of sample-clustered FL: a small CNN of cluster ids, trained federatedly with SCAFFOLD.

It reuses the project's own Federation, ClassificationClient and Scaffold callback, over the same boundary as
the main run: the selector's server is a second :class:`~fl_lightning.server.federation.Federation` (in a sub-run
directory ``selector/`` of the main run) whose tasks travel inside the main run's query tasks
(:class:`RelayTransport`); on each client side, DomainIsolation's client half hosts a selector runtime over the
client's own images and cluster ids. The selector's server sees only what any server sees: states, counts and
metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor, nn
from typing_extensions import override

from callbacks.scaffold import Scaffold
from datamodules.base import ClientSplit, FederatedDataModule
from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.clients.classification import ClassificationClient
from fl_lightning.config import FederationConfig
from fl_lightning.runtime import ClientRuntime
from fl_lightning.server.directory import ClientDirectory
from fl_lightning.server.federation import Federation
from fl_lightning.wire.protocol import Reply, Task
from fl_lightning.wire.transport import Transport

if TYPE_CHECKING:
    from fl_lightning.callback import FederatedCallback, ServerView

QUERY = "selector"  # the query that carries a selector task
SelectorRuntime = ClientRuntime  # what DomainIsolation's client half hosts for the selector's federation


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


def build_selector(
    in_channels: int, image_size: Any, n_clusters: int, width: int, lr: float = 0.005, weight_decay: float = 1e-3
) -> ClassificationClient:
    """A fresh selector CNN for images of this shape (plain SGD without momentum, as SCAFFOLD needs)."""
    return ClassificationClient(
        num_classes=n_clusters,
        in_channels=in_channels,
        image_size=image_size,
        arch="cnn",
        width=width,
        optimizer="sgd",
        lr=lr,
        momentum=0.0,
        weight_decay=weight_decay,
    )


def selector_trainer(device: torch.device, callbacks: list[L.Callback]) -> L.Trainer:
    """A Trainer for the selector on ``device`` (the CLI's defaults, no logger)."""
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    return L.Trainer(
        **{**TRAINER_DEFAULTS, "accelerator": accelerator, "devices": 1, "logger": False}, callbacks=callbacks
    )


def selector_splits(hosted: dict[str, tuple[ClientSplit, Tensor]], oracle: dict[int, int]) -> list[ClientSplit]:
    """Client side: each hosted client's (training image, cluster id), and its test set.

    The test sets are the clients' validation images (their test images when they have no validation split: the
    test set is otherwise read only at the end) labelled with their oracle cluster when the domains are known (so
    ``selector/summary.json`` reports routing accuracy), else their training images.

    Args:
        hosted: Per client, its data and the cluster id of each training sample.
        oracle: True domain → cluster (empty when the domains are unknown).
    """
    splits = []
    for cid, (split, labels) in hosted.items():
        held_x, held_domain = split.test_x, split.test_domain
        if split.val_y is not None and len(split.val_y):
            held_x, held_domain = split.val_x, split.val_domain
        if oracle and held_domain is not None:
            test_x, test_y = held_x, torch.tensor([oracle.get(int(d), 0) for d in held_domain])
        else:
            test_x, test_y = split.train_x, labels
        splits.append(ClientSplit(cid, split.train_x, labels.clone(), test_x, test_y.to(torch.int64)))
    return splits


def selector_runtime(splits: list[ClientSplit], settings: dict[str, Any], device: torch.device) -> ClientRuntime:
    """Client side: the runtime that trains and evaluates the selector on the hosted clients' splits."""
    data = ClusterIdData(splits, settings["n_clusters"], settings["batch_size"], settings["seed"])
    with torch.random.fork_rng(devices=[]):  # its initial weights are overwritten by every task; keep the RNG as is
        module = build_selector(
            data.in_channels, data.image_size, settings["n_clusters"], settings["width"], settings["lr"],
            settings["weight_decay"],
        )  # fmt: skip
    cfg = FederationConfig(rounds=settings["rounds"], local_steps=settings["local_steps"], progress=False)
    runtime = ClientRuntime(module, data, selector_trainer(device, [Scaffold()]), cfg, seed=settings["seed"])
    runtime.prepare()
    runtime.start(None)
    return runtime


class RelayTransport(Transport):
    """Carries a nested federation's tasks inside the outer federation's query tasks (and replies back).

    Args:
        server: The outer Federation.
        callback: The outer callback whose client half hosts the nested runtime.
        settings: What the client half needs to build that runtime (sent with every task).
    """

    name = "relay"

    def __init__(self, server: ServerView, callback: FederatedCallback, settings: dict[str, Any]) -> None:
        super().__init__()
        self.server, self.callback, self.settings = server, callback, settings

    @override
    def request(self, task: Task) -> Reply:
        payload = {"task": task, "settings": self.settings}
        return self.server.query(self.callback, QUERY, [task.client_id], payload)[task.client_id]

    @override
    def runtime_state(self) -> dict[str, Any]:
        raise NotImplementedError("the selector run keeps no checkpoints (its weights are in DomainIsolation's)")

    @override
    def load_runtime_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("the selector run keeps no checkpoints")


def train_selector(
    server: ServerView,
    callback: FederatedCallback,
    directory: ClientDirectory,
    image_shape: tuple[int, Any],
    settings: dict[str, Any],
) -> ClassificationClient:
    """Server side: train the selector with SCAFFOLD over the relay; returns it with its final global weights.

    Args:
        server: The main federation (its run directory and device).
        callback: DomainIsolation (its client half hosts the selector runtimes).
        directory: The clients' training and test sizes for the selector task.
        image_shape: ``(in_channels, image_size)`` of the images.
        settings: n_clusters, seed, rounds, local_steps, lr, weight_decay, width, batch_size, oracle.
    """
    # A private RNG stream: the selector's initialisation must not depend on (or disturb) the main run's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings["seed"])
        module = build_selector(
            *image_shape, settings["n_clusters"], settings["width"], settings["lr"], settings["weight_decay"]
        )
        cfg = FederationConfig(
            rounds=settings["rounds"],
            local_steps=settings["local_steps"],
            eval_every=0,
            output_dir=str(server.run_path),
            run_name="selector",
            quiet=True,
            plots=False,
            checkpoint_every=0,
        )
        trainer = selector_trainer(server.device, [Scaffold()])
        relay = RelayTransport(server, callback, settings)  # the client halves build their runtimes on the first task
        sub = Federation(cfg, module, directory, trainer, relay, seed=settings["seed"])
        sub.run()
    module.load_state_dict(sub.groups[0].state)
    return module.cpu()


@torch.inference_mode()
def predict_clusters(selector: nn.Module, images: Tensor, device: torch.device, batch_size: int = 256) -> Tensor:
    """The selector's predicted cluster id of every image (int64, CPU)."""
    was_training = selector.training
    selector.eval().to(device)
    preds = [selector(images[i : i + batch_size].to(device)).argmax(1).cpu() for i in range(0, len(images), batch_size)]
    selector.train(was_training)
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.int64)
