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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L
from typing_extensions import override

from fl_lightning.errors import PreconditionError
from fl_lightning.runtime.local_fit import LocalFitter, ResidentSingleDeviceStrategy

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
    """What starting or ending a client between two Lightning epochs raised (re-raised as it is after the fit)."""


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
    ) -> None:
        self.fitter, self.module, self.tasks = fitter, module, tasks
        self.begin, self.finish, self.fail, self.unbind = begin, finish, fail, unbind
        self.keep_optimizer_state = keep_optimizer_state
        self.replies: list[Reply] = []
        self.current: ClientFit | None = None
        self.epochs_given = 0
        self.before = 0

    def run(self) -> list[Reply]:
        """Fit from the first task on; the replies of the clients that ended (at least the first one's).

        Raises:
            Exception: What a client's start or end raised (a callback's ``on_client_start``, a loader), as it is;
                also ``PreconditionError`` from the fit (a method that cannot work here fails the run).
        """
        fitter = self.fitter
        self.current = self.begin(self.tasks[0])
        self.before, self.epochs_given = fitter.probe.batches, 0
        total = sum(local_passes(task) for task in self.tasks)
        try:
            first = (self.current.loader, self.current.task.client_id, self.current.optimizer_state)
            fitter.fit_round(self.module, RoundLoaders(self._next_loader), total, first, self.keep_optimizer_state)
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
            self.before, self.epochs_given = self.fitter.probe.batches, 1
            for cb in trainer.callbacks:
                cb.on_train_start(trainer, module)
            module.on_train_start()
            trainer.strategy.on_train_start()
        except Exception as err:
            raise SwitchError(f"starting or ending a client in a round fit raised {err!r}") from err
        return self.current.loader

    def _end_current(self) -> None:
        current = self.current
        assert current is not None
        ran = self.fitter.probe.batches - self.before
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
