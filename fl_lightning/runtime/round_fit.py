"""One Lightning fit that trains several clients in turn: Lightning's per-fit cost paid once per round.

A :class:`RoundFit` hands ``trainer.fit`` a data source (:class:`RoundLoaders`) that Lightning asks for a
loader at every epoch (``reload_dataloaders_every_n_epochs=1`` for this fit). Each client's local epochs are
Lightning epochs; at the first epoch of the next client the source ends the client that just trained (its
``on_train_end`` hooks, its reply), starts the next (its weights, ``on_client_start``, its loader), rebuilds the
optimiser from ``configure_optimizers`` and runs the ``on_train_start`` hooks. So everything Lightning calls per
step or per epoch, and ``on_train_start``/``on_train_end``, runs per client exactly as in a fit of its own, and the
client sees the same weights, batches and optimiser; only ``setup``, ``on_fit_start``, ``on_fit_end``,
``teardown`` and ``on_exception`` would run once per round, so a Trainer whose callbacks or module override them
keeps one fit per client (:func:`round_fit_blocker`).

By default a round fit goes one step further (``federation.client_loop``): Lightning sees ONE epoch of one batch
per client, and the client module's training step for that batch runs the client's local epochs itself, with
Lightning's manual optimisation (``manual_backward``, the ``LightningOptimizer``'s ``step``). So Lightning's
per-batch dispatch and its epoch boundary are paid once per client instead of once per local step and epoch,
while the hooks of the optimisation (``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``,
the module's ``backward``) still run at every local step, in the order of automatic optimisation (forward,
``zero_grad``, backward, step), so the weights are those of the epoch-per-client fit bit for bit. What this
changes: the batch and epoch hooks (``on_train_batch_*``, ``on_train_epoch_*``) run once per client and once per
round, and the hooks automatic optimisation alone calls (``on_before_zero_grad``, the module's ``optimizer_step``,
``optimizer_zero_grad``, ``configure_gradient_clipping``) do not run; a Trainer or module that overrides any of
them, or that needs what manual optimisation lacks (gradient clipping, accumulation, learning-rate schedulers),
keeps Lightning's loop per local step (:func:`client_loop_blocker`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from typing_extensions import override

from fl_lightning.clients.base import ClientModule
from fl_lightning.errors import PreconditionError
from fl_lightning.runtime.local_fit import FitProbe, LocalFitter, ResidentSingleDeviceStrategy

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, FederatedCallback
    from fl_lightning.wire.protocol import Reply, Task

# Hooks Lightning calls once per `trainer.fit`, which a round fit cannot repeat per client.
CALLBACK_FIT_HOOKS = ("setup", "teardown", "on_fit_start", "on_fit_end", "on_exception")
MODULE_FIT_HOOKS = ("setup", "teardown", "on_fit_start", "on_fit_end", "configure_callbacks", "train_dataloader",
                    "val_dataloader")  # fmt: skip


def _overrides(obj: object, base: type, hook: str) -> bool:
    return getattr(type(obj), hook, None) is not getattr(base, hook, None)


def round_fit_blocker(trainer: L.Trainer, module: L.LightningModule) -> str | None:
    """Why this Trainer and module need one Lightning fit per client, or None if one fit per round can train them.

    Args:
        trainer: The shared Trainer (its strategy already made resident by the fitter).
        module: The client module.

    Returns:
        A sentence for the log, naming the callback, hook or Trainer setting; None if nothing needs a fit per client.
    """
    if not isinstance(trainer.strategy, ResidentSingleDeviceStrategy):
        return f"the Trainer's strategy {type(trainer.strategy).__name__} is not a single-device one"
    if trainer.reload_dataloaders_every_n_epochs:
        return "trainer.reload_dataloaders_every_n_epochs is set"
    if trainer.max_steps != -1 or trainer.min_steps or trainer.min_epochs:
        return "the Trainer has a step or epoch limit (trainer.max_steps, min_steps or min_epochs)"
    for cb in trainer.callbacks:
        for hook in CALLBACK_FIT_HOOKS:
            if _overrides(cb, L.Callback, hook):
                return f"callback {type(cb).__name__} overrides {hook}, which Lightning calls once per fit"
    for hook in MODULE_FIT_HOOKS:
        if _overrides(module, L.LightningModule, hook):
            return f"the module {type(module).__name__} overrides {hook}, which Lightning calls once per fit"
    return None


# What a client loop does with the hooks it cannot run as Lightning's loop does (it shows Lightning one batch per
# client, and optimises manually).
_PER_CLIENT, _PER_ROUND = "calls once per client, not per local batch", "calls once per round, not per local epoch"
_AUTOMATIC = "does not call (only automatic optimisation does)"
CALLBACK_LOOP_HOOKS = {"on_train_batch_start": _PER_CLIENT, "on_train_batch_end": _PER_CLIENT,
                       "on_train_epoch_start": _PER_ROUND, "on_train_epoch_end": _PER_ROUND,
                       "on_before_zero_grad": _AUTOMATIC}  # fmt: skip
MODULE_LOOP_HOOKS = {**CALLBACK_LOOP_HOOKS, "optimizer_step": _AUTOMATIC, "optimizer_zero_grad": _AUTOMATIC,
                     "configure_gradient_clipping": _AUTOMATIC, "lr_scheduler_step": _AUTOMATIC,
                     "on_before_batch_transfer": "does not call (only Lightning's batch loop does)"}  # fmt: skip


def client_loop_blocker(trainer: L.Trainer, module: L.LightningModule) -> str | None:
    """Why a round fit of this Trainer and module needs Lightning's loop per local step, or None if not.

    Checked once a round fit is allowed (:func:`round_fit_blocker` is None).

    Args:
        trainer: The shared Trainer.
        module: The client module.

    Returns:
        A sentence for the log, naming the callback, hook or Trainer setting; None if the client loop can train it.
    """
    if not isinstance(module, ClientModule) or type(module).training_step is not ClientModule.training_step:
        return f"the module {type(module).__name__} does not use ClientModule's training_step"
    if not module.automatic_optimization:
        return "the module turns Lightning's automatic optimisation off"
    if trainer.gradient_clip_val:
        return "trainer.gradient_clip_val is set (manual optimisation does not clip)"
    if trainer.accumulate_grad_batches != 1:
        return "trainer.accumulate_grad_batches is not 1 (manual optimisation does not accumulate)"
    if trainer.limit_train_batches != 1.0:
        return "trainer.limit_train_batches is set (it would count clients, not batches)"
    if type(trainer.precision_plugin) not in (Precision, MixedPrecision):
        return f"the precision plugin {type(trainer.precision_plugin).__name__} is not 32-bit or mixed"
    for cb in trainer.callbacks:
        for hook, meaning in CALLBACK_LOOP_HOOKS.items():
            if not isinstance(cb, FitProbe) and _overrides(cb, L.Callback, hook):  # the probe counts turns there
                return f"callback {type(cb).__name__} overrides {hook}, which a client loop {meaning}"
    for hook, meaning in MODULE_LOOP_HOOKS.items():
        if _overrides(module, ClientModule, hook):
            return f"the module {type(module).__name__} overrides {hook}, which a client loop {meaning}"
    configured = module.configure_optimizers()
    if not isinstance(configured, torch.optim.Optimizer):
        return "configure_optimizers returns more than one optimiser, or a learning-rate scheduler"
    return None


def local_passes(task: Task) -> int:
    """The passes over its loader a fit task asks for: its epochs, or one pass of ``task.steps`` batches."""
    return 1 if task.steps else task.epochs


class RoundLoaders(L.LightningDataModule):
    """The round fit's data source: each epoch's loader comes from ``next_loader`` (which may switch clients)."""

    def __init__(self, next_loader: Callable[[], Any]) -> None:
        super().__init__()
        self.next_loader = next_loader

    @override
    def train_dataloader(self) -> Any:
        return self.next_loader()


@dataclass
class ClientFit:
    """One client's part of a fit: its task, its callbacks' bound contexts, its loader and budget."""

    task: Task
    contexts: list[tuple[FederatedCallback, ClientContext]]
    loader: Any
    epochs: int
    optimizer_state: dict[str, Any] | None


class SwitchError(Exception):
    """What starting or ending a client between two of its fit's parts raised (re-raised as it is after the fit)."""


class _TurnStarts(L.Callback):
    """Switches a client loop to each turn's client at the turn's batch start.

    There, not in the training step: Lightning's manual optimisation binds its step counting to the
    ``LightningOptimizer`` between the two, so the next client's fresh optimiser must exist by then.
    """

    def __init__(self, start_turn: Callable[[int], None]) -> None:
        self.start_turn = start_turn

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.start_turn(batch)


class RoundFit:
    """Trains ``tasks``' clients one after another in ONE ``trainer.fit``; their replies in task order.

    A client whose training raises is answered with an error and the fit ends there; :meth:`run` returns the
    replies so far and the caller starts another round fit for the clients left. A client that ends with a
    non-finite loss or weights is answered with an error by ``finish`` and the fit goes on with the next.

    Args:
        fitter: The runtime's fitter (its Trainer and probe).
        module: The client module.
        tasks: The fit tasks, at least one.
        begin: Starts a client (weights, contexts, ``on_client_start``, loader) as for a fit of its own.
        finish: Ends a client that trained ``steps`` batches: its reply (``on_client_end``, ``on_upload``).
        fail: The reply of a client whose training raised ``err``.
        unbind: Detaches a client's contexts from the callbacks.
        keep_optimizer_state: Capture each client's optimiser state at its end.
        client_loop: Run each client's local epochs inside one Lightning step (see the module's docstring); the
            caller has checked :func:`client_loop_blocker`.
    """

    def __init__(
        self,
        fitter: LocalFitter,
        module: L.LightningModule,
        tasks: list[Task],
        begin: Callable[[Task], ClientFit],
        finish: Callable[[ClientFit, int, dict[str, Any] | None], Reply],
        fail: Callable[[ClientFit, Exception], Reply],
        unbind: Callable[[ClientFit], None],
        keep_optimizer_state: bool,
        client_loop: bool = False,
    ) -> None:
        self.fitter, self.module, self.tasks = fitter, module, tasks
        self.begin, self.finish, self.fail, self.unbind = begin, finish, fail, unbind
        self.keep_optimizer_state = keep_optimizer_state
        self.client_loop = client_loop
        self.replies: list[Reply] = []
        self.current: ClientFit | None = None
        self.epochs_given = 0
        self.before = 0  # the probe's batches when the current client started (Lightning's loop per step)
        self.loop_steps = 0  # the local steps the current client ran (client loop)

    def run(self) -> list[Reply]:
        """Fit from the first task on; the replies of the clients that ended (at least the first one's).

        Raises:
            Exception: What a client's start or end raised (a callback's ``on_client_start``, a loader), as it is;
                also ``PreconditionError`` from the fit (a method that cannot work here fails the run).
        """
        fitter = self.fitter
        self.current = self.begin(self.tasks[0])
        self.before, self.epochs_given, self.loop_steps = fitter.probe.batches, 0, 0
        try:
            first = (self.current.loader, self.current.task.client_id, self.current.optimizer_state)
            if self.client_loop:
                turns = _TurnStarts(self._start_turn)
                fitter.fit_turns(self.module, len(self.tasks), first, self.keep_optimizer_state, self._turn, turns)
            else:
                total = sum(local_passes(task) for task in self.tasks)
                source = RoundLoaders(self._next_loader)
                fitter.fit_round(self.module, source, total, first, self.keep_optimizer_state)
        except SwitchError as err:
            self._unbind_current()
            raise err.__cause__ from None  # type: ignore[misc]
        except PreconditionError:
            self._unbind_current()
            raise
        except Exception as err:  # noqa: BLE001 - one client's failure must not end the run
            assert self.current is not None
            self.replies.append(self.fail(self.current, err))
            self._unbind_current()
            return self.replies
        self._end_current()  # the last client to train (Lightning ran its on_train_end hooks)
        return self.replies

    def _next_loader(self) -> Any:
        """The loader of the next epoch: the current client's until its epochs are given, then the next client's."""
        current = self.current
        assert current is not None  # Lightning asks for no loader after the fit's last epoch
        if self.epochs_given < current.epochs:
            self.epochs_given += 1
            return current.loader
        self._switch()
        self.epochs_given = 1
        assert self.current is not None
        return self.current.loader

    def _start_turn(self, turn: int) -> None:
        """Client loop: before turn ``turn``'s step, switch to its client (the first one is started already)."""
        if turn > 0:
            self._switch()

    def _turn(self, turn: int, _: int) -> None:
        """Client loop: the module's training step for turn ``turn``, i.e. its client's local epochs.

        Each local batch goes through the module's own ``training_step`` (its loss, the round report's running
        loss), then ``zero_grad``, ``manual_backward`` and the ``LightningOptimizer``'s ``step``: the order of
        automatic optimisation, whose closure runs the forward pass, then ``zero_grad``, then backward.
        """
        current, module = self.current, self.module
        assert current is not None and turn == len(self.replies)
        strategy = self.fitter.trainer.strategy
        optimizer = module.optimizers()
        if isinstance(optimizer, list) or strategy.lr_scheduler_configs:
            raise PreconditionError(
                "the client loop (federation.client_loop) trains one optimiser without learning-rate schedulers; "
                "configure_optimizers returned something else for client "
                f"{current.task.client_id!r} (set federation.client_loop=false)"
            )
        _refuse_epoch_samplers(current.loader, current.task.client_id)
        training_step = type(module).training_step
        # This whole step runs in the precision plugin's training context (autocast under mixed precision), where
        # automatic optimisation runs only the forward pass: backward and the update leave it, as they do there.
        outside = torch.autocast(module.device.type, enabled=False)
        for _ in range(current.epochs):
            for batch_idx, batch in enumerate(current.loader):
                loss = training_step(module, strategy.batch_to_device(batch), batch_idx)
                with outside:
                    optimizer.zero_grad()
                    module.manual_backward(loss)
                    optimizer.step()
                self.loop_steps += 1

    def _switch(self) -> None:
        """End the current client (its ``on_train_end`` hooks, its reply) and start the next one as a fit would."""
        try:
            trainer, module = self.fitter.trainer, self.module
            for cb in trainer.callbacks:  # in Lightning's order: callbacks, module, strategy
                cb.on_train_end(trainer, module)
            module.on_train_end()
            trainer.strategy.on_train_end()
            self._end_current()
            self.current = self.begin(self.tasks[len(self.replies)])
            client = self.current
            self.fitter.restart_optimizer(
                client.loader, client.task.client_id, client.optimizer_state, self.keep_optimizer_state
            )
            self.before, self.loop_steps = self.fitter.probe.batches, 0
            for cb in trainer.callbacks:
                cb.on_train_start(trainer, module)
            module.on_train_start()
            trainer.strategy.on_train_start()
        except Exception as err:
            raise SwitchError(f"starting or ending a client in a round fit raised {err!r}") from err

    def _end_current(self) -> None:
        current = self.current
        assert current is not None
        ran = self.loop_steps if self.client_loop else self.fitter.probe.batches - self.before
        try:
            self.fitter.check_ran(ran, current.epochs, current.loader, current.task.client_id)
        except RuntimeError as err:
            reply = self.fail(current, err)
        else:
            reply = self.finish(current, ran, self.fitter.probe.captured_optimizer_state)
        self._unbind_current()
        self.replies.append(reply)

    def _unbind_current(self) -> None:
        if self.current is not None:
            self.unbind(self.current)
            self.current = None


def _refuse_epoch_samplers(loader: Any, client_id: str) -> None:
    """Refuse a loader whose sampler has ``set_epoch``, which Lightning calls with the Trainer's epoch.

    A client loop draws the loader's passes itself, so such a sampler would shuffle alike in every pass: refused
    rather than silently changed.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)):
            raise PreconditionError(
                f"the training loader of client {client_id!r} has a sampler with set_epoch "
                f"({type(sampler).__name__}), which Lightning calls with the Trainer's epoch and a client loop "
                "does not; set federation.client_loop=false, or use datamodules.sampler.SeededEpochSampler"
            )
