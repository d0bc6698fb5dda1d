"""Shared builders: a tiny federation on the embedded digits that trains in well under a second."""

from __future__ import annotations

import os

# One intra-op thread for the whole suite (and the subprocesses it starts): the tiny models here are dominated by
# per-op overhead, and two threads on two shared cores were up to 40x slower under load.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Lightning 2.6's CLI calls jsonargparse API that jsonargparse deprecates: its documented switch keeps it quiet
os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from datamodules import DigitsFederated
from fl_lightning import ClassificationClient, Federation, FederationConfig, local_federation
from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.server.selection import select_clients

torch.set_num_threads(1)


def tiny_data(num_clients: int = 3, **kwargs: Any) -> DigitsFederated:
    """Digits at 8×8, at most 40 samples per client."""
    args = {"num_clients": num_clients, "image_size": 8, "max_samples_per_client": 40, "batch_size": 8, "seed": 0}
    args.update(kwargs)
    return DigitsFederated(**args)


def tiny_model(data: DigitsFederated, **kwargs: Any) -> ClassificationClient:
    """A 4/8-channel CNN sized for ``data``, seeded so every build starts from the same weights."""
    torch.manual_seed(0)
    args = {"arch": "cnn", "width": 4, "lr": 0.1, "momentum": 0.0}
    args.update(kwargs)
    return ClassificationClient(
        num_classes=data.num_classes, in_channels=data.in_channels, image_size=data.image_size, **args
    )


def build_federation(
    tmp_path: Any,
    callbacks: Sequence[L.Callback] = (),
    data: DigitsFederated | None = None,
    model: ClassificationClient | None = None,
    model_kwargs: dict[str, Any] | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    **config: Any,
) -> Federation:
    """A Federation over tiny digits on the CPU with the CLI's Trainer defaults (and ``trainer_kwargs``)."""
    data = data or tiny_data()
    model = model or tiny_model(data, **(model_kwargs or {}))
    trainer_args = {**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False, "callbacks": list(callbacks)}
    trainer_args.update(trainer_kwargs or {})
    cfg = FederationConfig(**{"rounds": 2, "output_dir": str(tmp_path), "quiet": True, "plots": False, **config})
    return local_federation(cfg, model, data, L.Trainer(**trainer_args), seed=0)


def reference_sgd(
    net: torch.nn.Module,
    rounds_of_batches: Iterable[Iterable[tuple[torch.Tensor, torch.Tensor]]],
    lr: float,
    momentum: float = 0.0,
    mu: float = 0.0,
    fresh_optimizer_each_round: bool = True,
) -> dict[str, torch.Tensor]:
    """A plain PyTorch training loop (the independent reference): CE + optional proximal term μ/2‖w − w_round‖²."""
    net = copy.deepcopy(net).train()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for batches in rounds_of_batches:
        if fresh_optimizer_each_round:
            opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        anchor = [p.detach().clone() for p in net.parameters()]
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            with torch.no_grad():
                for p, a in zip(net.parameters(), anchor):
                    p.grad.add_(p - a, alpha=mu)
            opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def reference_scaffold(
    rounds: int,
    per_round: int,
    lrs: Sequence[float],
    control_lrs: Sequence[float] | None = None,
    data_kwargs: dict[str, Any] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SCAFFOLD option II written out in plain PyTorch over the same batches and client samples.

    Round r trains with learning rate ``lrs[r]``; ``control_lrs[r]`` is the η of the control-variate update
    c_i⁺ = c_i − c + (w − w_i)/(τ η) (default ``lrs``). Returns the final global weights and server control c.
    """
    control_lrs = control_lrs or lrs
    data = tiny_data(**(data_kwargs or {}))
    module = tiny_model(data)
    ids = data.client_ids
    w = copy.deepcopy(module.state_dict())
    names = [k for k, _ in module.named_parameters()]
    c = {k: torch.zeros_like(w[k]) for k in names}
    c_i = {cid: {k: torch.zeros_like(w[k]) for k in names} for cid in ids}
    for r in range(rounds):
        selected = select_clients(ids, r, seed=0, k=per_round)
        n = [data.num_train_samples(c) for c in selected]
        p = [ni / sum(n) for ni in n]
        states, delta = [], {k: torch.zeros_like(w[k]) for k in names}
        for cid in selected:
            module.load_state_dict(w)
            module.train()
            opt = torch.optim.SGD(module.parameters(), lr=lrs[r])
            steps = 0
            for x, y in data.client_train_loader(cid):
                opt.zero_grad()
                F.cross_entropy(module(x), y).backward()
                for k, prm in module.named_parameters():
                    prm.grad.add_(c[k] - c_i[cid][k])
                opt.step()
                steps += 1
            w_i = copy.deepcopy(module.state_dict())
            new = {k: c_i[cid][k] - c[k] + (w[k] - w_i[k]) / (steps * control_lrs[r]) for k in names}
            for k in names:
                delta[k] += new[k] - c_i[cid][k]
            c_i[cid] = new
            states.append(w_i)
        w = {k: sum(pi * s[k].double() for pi, s in zip(p, states)).to(w[k].dtype) for k in w}
        c = {k: c[k] + delta[k] / len(ids) for k in names}  # |S|/N · mean over S = Σ_S / N
    return w, c


@pytest.fixture
def quiet_lightning(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing; present so tests can request it without Lightning's info logs cluttering failures."""
    caplog.set_level("WARNING")
