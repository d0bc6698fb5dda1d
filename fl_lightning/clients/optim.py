"""The local optimisers client modules offer by name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def build_optimizer(
    params: Iterable[torch.nn.Parameter], name: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """A fresh ``sgd`` (with ``momentum``), ``adam`` or ``adamw`` optimiser.

    Raises:
        ValueError: On an unknown name, naming the config key.
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"model.optimizer must be sgd, adam or adamw, got {name!r}")


def configured_optimizer(module: Any) -> torch.optim.Optimizer:
    """A fresh optimiser for ``module``'s parameters, as its hyper-parameters name it, at the round's learning rate.

    ``optimizer``, ``momentum`` and ``weight_decay`` from ``module.hparams``; the learning rate is
    ``lr · module.lr_factor`` (``callbacks.LRSchedule`` sets the factor before each fit).
    """
    hp = module.hparams
    return build_optimizer(module.parameters(), hp.optimizer, hp.lr * module.lr_factor, hp.momentum, hp.weight_decay)
