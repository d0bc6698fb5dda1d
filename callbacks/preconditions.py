"""Loud checks of what a method assumes about the client's optimiser, Trainer, network and data."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from fl_lightning.errors import PreconditionError


def single_optimizer(module: L.LightningModule, method: str) -> torch.optim.Optimizer:
    """The one optimiser the module configures, or a PreconditionError naming ``method``."""
    if not module.automatic_optimization:
        raise PreconditionError(f"{method} needs Lightning's automatic optimisation (module.automatic_optimization)")
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)):
        if len(configured) != 1:
            raise PreconditionError(f"{method} needs exactly one optimiser, the module configures {len(configured)}")
        configured = configured[0]
    if not isinstance(configured, torch.optim.Optimizer):
        raise PreconditionError(
            f"{method} could not find the module's optimiser (configure_optimizers returned {configured!r})"
        )
    return configured


def plain_sgd(module: L.LightningModule, trainer: L.Trainer, method: str, allow_momentum: bool) -> dict[str, float]:
    """Check the local optimiser is SGD (without momentum unless allowed) and one batch makes one step.

    Returns:
        The optimiser's first parameter group hyper-parameters (lr, momentum, …).

    Raises:
        PreconditionError: Naming the method, the setting it needs and how to set it.

    """
    opt = single_optimizer(module, method)
    group = opt.param_groups[0]
    if not isinstance(opt, torch.optim.SGD):
        raise PreconditionError(
            f"{method} assumes plain local SGD, the module uses {type(opt).__name__} (set model.optimizer=sgd)"
        )
    if group.get("nesterov"):
        raise PreconditionError(f"{method} does not support Nesterov momentum")
    if not allow_momentum and group.get("momentum", 0) != 0:
        raise PreconditionError(
            f"{method} assumes SGD without momentum, got momentum={group['momentum']} (set model.momentum=0)"
        )
    if trainer.accumulate_grad_batches != 1:
        raise PreconditionError(f"{method} counts one optimiser step per batch; set trainer.accumulate_grad_batches=1")
    return {k: v for k, v in group.items() if k != "params"}


def trainable_names(module: L.LightningModule) -> list[str]:
    """State-dict names of the trainable parameters, in ``named_parameters`` order."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


def refuse_tables(data: Any, method: str) -> None:
    """Refuse data that are not images for a method that works on images, naming the data and the fix.

    Reads the datamodule's public ``sample_kind``. What has none is taken for images: a deployment's server holds a
    :class:`~fl_lightning.server.directory.ClientDirectory` (ids and sizes, no data), and the clients' runtimes,
    which hold the data, check them there.

    Args:
        data: The datamodule (or the server's client directory) the method is prepared with.
        method: The method's config name, e.g. ``callbacks.AmplitudeNormalization``.

    Raises:
        PreconditionError: If ``data.sample_kind`` is not ``"image"`` (e.g. a clinical table's ``"table"``).
    """
    kind = getattr(data, "sample_kind", "image")
    if kind != "image":
        what = "a table" if kind == "table" else "not images"
        raise PreconditionError(
            f"{method} works on images: the data ({type(data).__module__}.{type(data).__qualname__}) are {what} "
            f"(sample_kind={kind!r}); use it with image data or remove it from trainer.callbacks"
        )
