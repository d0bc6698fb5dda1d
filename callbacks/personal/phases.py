"""One client fit in two phases: the global model's epochs (uploaded), then the personal model's (kept on the site).

Ditto and APFL train two models per client. Lightning's contract is one ``trainer.fit`` per client, on the user's
module and its one optimiser, so both models are trained in that fit, one after the other: the task asks for the
global epochs plus the personal ones; the loader serves the client's usual batches for the global epochs (exactly
the batches FedAvg would draw) and the personal model's own seeded batches after them; at the first personal epoch
the trained global weights and the optimiser's state are set aside and the personal model is loaded into the same
parameters; when the fit ends the personal model is kept (:attr:`ClientContext.personal`) and the global weights
and optimiser state are put back, so the reply uploads the global model only.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import single_optimizer, trainable_names
from datamodules.sampler import SeededEpochSampler, stable_seed
from fl_lightning.errors import PreconditionError
from fl_lightning.ops import clone_state

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from fl_lightning.callback import ClientContext, RuntimeView, ServerView
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Task

PASSES = "personal_passes"  # ctx.state: passes the client's personal sampler has drawn (its batches resume there)


class PhasedLoader:
    """The task's loader until :attr:`personal_phase` is set, the personal one after.

    The callback sets the phase in ``on_train_epoch_start``, which Lightning calls before it iterates the epoch's
    batches (its documented hook order); counting ``iter()`` calls instead would miscount, as Lightning also
    iterates a loader once to check that it can. Both loaders are over the same client's training set with the same
    batch size, so they have the same length.
    """

    def __init__(self, global_loader: Iterable[Any], personal: Iterable[Any]) -> None:
        self.global_loader, self.personal = global_loader, personal
        self.personal_phase = False

    def _current(self) -> Iterable[Any]:
        return self.personal if self.personal_phase else self.global_loader

    def __len__(self) -> int:
        return len(self._current())  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._current())


def personal_loader(ctx: ClientContext, method: str) -> tuple[DataLoader, SeededEpochSampler]:
    """The client's personal batches: its training set through a sampler of its own, resumed at its passes.

    The sampler is seeded by (run seed, ``method``, client), so the global epochs keep the client's usual sampler
    (FedAvg's batches) and the personal batches do not depend on which process hosts the client.
    """
    n = ctx.data.num_train_samples(ctx.client_id)
    sampler = SeededEpochSampler(n, stable_seed(ctx.seed, method, "personal", ctx.client_id))
    sampler.epoch = int(ctx.state.get(PASSES, 0))
    return ctx.data.client_subset_train_loader(ctx.client_id, torch.arange(n), sampler), sampler


class TwoPhaseFit(FederatedCallback):
    """The server and client halves of a method that trains a global and a personal model in one fit.

    A subclass says what the personal phase does: :meth:`enter_personal` (load the personal model into the
    module), :meth:`on_before_optimizer_step` / :meth:`on_train_batch_end` during it, and :meth:`personal_result`
    (the personal model to keep, and its private state). The global epochs are the task's (``federation.local_epochs``);
    the personal ones are ``personal_epochs`` (default: as many).

    Args:
        personal_epochs: Epochs of the personal model per fit (None: ``federation.local_epochs``).
    """

    def __init__(self, personal_epochs: int | None = None) -> None:
        super().__init__()
        if personal_epochs is not None and personal_epochs < 1:
            raise ValueError(f"{type(self).__name__} personal_epochs must be >= 1, got {personal_epochs}")
        self.personal_epochs = personal_epochs
        self._names: list[str] = []
        self._run: dict[str, Any] | None = None  # the running fit's phase state

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: ServerView) -> None:
        if server.config.local_steps is not None:
            raise PreconditionError(
                f"{type(self).__name__} trains its global and personal models in epochs: set federation.local_epochs "
                f"(and personal_epochs), not federation.local_steps={server.config.local_steps}"
            )

    @override
    def configure_task(self, server: ServerView, task: Task) -> None:
        extra = self.personal_epochs or server.config.local_epochs
        self.put_payload(task, {"global_epochs": task.epochs})
        task.epochs = task.epochs + extra  # the personal epochs come after the global ones

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        single_optimizer(runtime.module, type(self).__name__)
        self._names = trainable_names(runtime.module)

    @override
    def wrap_train_loader(self, ctx: ClientContext, loader: DataLoader) -> Any:
        personal, sampler = personal_loader(ctx, type(self).__name__)
        phased = PhasedLoader(loader, personal)
        self._run = {"sampler": sampler, "global_epochs": int(ctx.payload["global_epochs"]), "personal": False,
                     "loader": phased}  # fmt: skip
        return phased

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._run["start"] = trainer.current_epoch

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        run = self._run
        if run["personal"] or trainer.current_epoch - run["start"] < run["global_epochs"]:
            return
        run["personal"] = run["loader"].personal_phase = True
        optimizer = trainer.optimizers[0]
        run["global_state"] = clone_state(pl_module.state_dict())
        run["global_optimizer"] = copy.deepcopy(optimizer.state_dict())
        ctx = self.fit_context
        kept = ctx.state.get("optimizer") if ctx.config.keep_optimizer_state else None
        # the personal model's own optimiser state: its last one if the run keeps them, else a fresh one
        optimizer.load_state_dict(kept or {"state": {}, "param_groups": run["global_optimizer"]["param_groups"]})
        named = dict(pl_module.named_parameters())
        run["params"] = [named[k] for k in self._names]
        run["received"] = {**ctx.received, **ctx.private}  # w^t as the fit started: the personal phase's anchor
        self.enter_personal(ctx, pl_module, run)

    def in_personal_phase(self) -> bool:
        """Whether the running fit is in its personal epochs."""
        return self._run is not None and self._run["personal"]

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        run, ctx = self._run, self.fit_context
        if not run["personal"]:
            return
        personal, private = self.personal_result(ctx, pl_module, run)
        ctx.personal = personal
        ctx.state.update(private)
        ctx.state[PASSES] = run["sampler"].epoch
        optimizer = trainer.optimizers[0]
        if ctx.config.keep_optimizer_state:
            ctx.state["optimizer"] = copy.deepcopy(optimizer.state_dict())
        pl_module.load_state_dict(run["global_state"])  # the reply uploads the global model
        optimizer.load_state_dict(run["global_optimizer"])

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Any) -> None:
        self._run = None

    # ------------------------------------------------------------------ what a subclass says
    def enter_personal(self, ctx: ClientContext, module: L.LightningModule, run: dict[str, Any]) -> None:
        """Load the personal model into ``module`` (``ctx.personal``, or at first ``run["received"]``, w^t)."""
        raise NotImplementedError

    def personal_result(
        self, ctx: ClientContext, module: L.LightningModule, run: dict[str, Any]
    ) -> tuple[StateDict, dict[str, Any]]:
        """After the personal epochs: the personal model to evaluate and keep, and entries for ``ctx.state``."""
        raise NotImplementedError
