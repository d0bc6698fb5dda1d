"""One client's local training on the shared Trainer: the step a distributed backend would replace."""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, RandomSampler
from typing_extensions import override

# Clients feed in-memory tensors; worker processes would cost more than they save.
warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
# Emitted by Lightning 2.6 itself on every fit with torch 2.14; nothing a user can act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


class _DropFitStoppedMessage(logging.Filter):
    """Every client fit ends at its raised epoch budget, so Lightning's 'fit stopped' notice is noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`Trainer.fit` stopped" not in record.getMessage()


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropFitStoppedMessage())


class FitProbe(L.Callback):
    """Counts training batches and carries optimiser state across fits when asked to."""

    def __init__(self) -> None:
        self.batches = 0
        self.pending_optimizer_state: dict[str, Any] | None = None
        self.capture_optimizer_state = False
        self.captured_optimizer_state: dict[str, Any] | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.pending_optimizer_state is not None:
            optimizer = trainer.optimizers[0]
            # load_state_dict restores the buffers (momentum, Adam moments) AND the hyper-parameters saved with
            # them, i.e. the learning rate of the client's previous fit. Keep the buffers but re-apply the
            # learning rate this fit's configure_optimizers set, so a per-round schedule (module.lr_factor,
            # callbacks.LRSchedule) also holds with federation.keep_optimizer_state.
            fresh_lrs = [group["lr"] for group in optimizer.param_groups]
            optimizer.load_state_dict(self.pending_optimizer_state)
            for group, lr in zip(optimizer.param_groups, fresh_lrs, strict=True):
                group["lr"] = lr
            self.pending_optimizer_state = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.batches += 1

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.capture_optimizer_state:
            # deep copy: the live optimiser's buffers are overwritten by the next client's fit
            self.captured_optimizer_state = copy.deepcopy(trainer.optimizers[0].state_dict())


class ResidentSingleDeviceStrategy(SingleDeviceStrategy):
    """Lightning's single-device strategy, except that a fit's teardown leaves the module where it is.

    After every ``trainer.fit`` Lightning moves the module and the optimiser state to the CPU and, on
    CUDA, empties the allocator cache: right at the end of one training run, wasteful when the next
    client's fit moves the same module back a moment later (on an H200 ~10 ms per client fit, most
    of the fixed cost of a fit). The Federation copies what it keeps out of the module itself
    (``clone_state`` to the CPU), so nothing depends on the module being on the CPU between fits.
    """

    @override
    def teardown(self) -> None:
        self.precision_plugin.teardown()
        self.checkpoint_io.teardown()


class LocalFitter:
    """Runs ``trainer.fit`` for one client at a time on ONE Trainer.

    Lightning's fit loop stops once ``current_epoch`` reaches ``max_epochs``, so a second
    ``fit`` would silently do nothing; before each fit the budget is raised by the client's local
    epochs, and after it the number of batches actually run is checked. A single-device strategy is
    made resident (:class:`ResidentSingleDeviceStrategy`): the module stays on its device between fits.

    Args:
        trainer: The shared Trainer.

    Raises:
        ValueError: If the Trainer carries callbacks whose state would leak between clients.

    """

    def __init__(self, trainer: L.Trainer) -> None:
        leaky = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, (EarlyStopping, ModelCheckpoint))]
        if leaky:
            raise ValueError(
                f"trainer.callbacks holds {leaky}: their state would carry over from one client to the next. "
                "Remove them (set trainer.enable_checkpointing=false); the Federation checkpoints rounds itself."
            )
        if type(trainer.strategy) is SingleDeviceStrategy:
            # The Trainer built its strategy from its flags (accelerator, devices, precision); changing the
            # class of that object keeps all of its state and only replaces ``teardown``.
            trainer.strategy.__class__ = ResidentSingleDeviceStrategy
        self.trainer = trainer
        self._warned_random_sampler = False
        # Runtimes sharing a Trainer (the nodes one Simulation Engine actor serves) share its probe: each fit sets
        # what the probe restores and reads what it captured, and fits run one at a time.
        probes = [cb for cb in trainer.callbacks if isinstance(cb, FitProbe)]
        self.probe = probes[0] if probes else FitProbe()
        if not probes:
            trainer.callbacks.append(self.probe)

    def fit(
        self,
        module: L.LightningModule,
        loader: DataLoader,
        epochs: int,
        client_id: str,
        optimizer_state: dict[str, Any] | None = None,
        keep_optimizer_state: bool = False,
    ) -> tuple[int, dict[str, Any] | None]:
        """Train ``module`` for ``epochs`` passes over ``loader``.

        Args:
            module: The client module, already holding the client's starting weights.
            loader: The client's training loader.
            epochs: Local epochs.
            client_id: For error messages.
            optimizer_state: Optimiser state to restore before the first step (from the client's last fit).
            keep_optimizer_state: Return the optimiser state after training.

        Returns:
            The number of training batches run, and the optimiser state if asked for.

        Raises:
            RuntimeError: If the fit ran no batch at all.

        """
        trainer = self.trainer
        self._prepare(loader, client_id, epochs, optimizer_state, keep_optimizer_state)
        before = self.probe.batches
        trainer.fit(module, train_dataloaders=loader)
        ran = self.probe.batches - before
        self.check_ran(ran, epochs, loader, client_id)
        return ran, self.probe.captured_optimizer_state

    def fit_round(
        self,
        module: L.LightningModule,
        source: L.LightningDataModule,
        epochs: int,
        first: tuple[DataLoader, str, dict[str, Any] | None],
        keep: bool,
    ) -> None:
        """One ``trainer.fit`` of ``epochs`` epochs in total, each epoch's loader from ``source`` (a round fit).

        Args:
            module: The client module, holding the first client's starting weights.
            source: The data source that switches clients between epochs (:class:`~.round_fit.RoundLoaders`).
            epochs: The local epochs of every client of the fit together.
            first: The first client's loader, id and optimiser state (restored before its first step).
            keep: Capture each client's optimiser state at its end.
        """
        trainer = self.trainer
        loader, client_id, optimizer_state = first
        self._prepare(loader, client_id, epochs, optimizer_state, keep)
        reload = trainer.reload_dataloaders_every_n_epochs
        trainer.reload_dataloaders_every_n_epochs = 1  # Lightning asks the source for each epoch's loader
        try:
            trainer.fit(module, datamodule=source)
        finally:
            trainer.reload_dataloaders_every_n_epochs = reload

    def fit_turns(
        self,
        module: L.LightningModule,
        turns: int,
        first: tuple[DataLoader, str, dict[str, Any] | None],
        keep: bool,
        step: Callable[[int, int], None],
        starts: L.Callback,
    ) -> None:
        """One ``trainer.fit`` of one epoch of ``turns`` batches, each a client's whole local training (a client loop).

        For this fit the module's ``training_step`` is ``step`` (called with the turn's index and Lightning's batch
        index) and its automatic optimisation is off, so ``step`` optimises through ``manual_backward`` and the
        ``LightningOptimizer``; both are restored after the fit, also when it raises.

        Args:
            module: The client module, holding the first client's starting weights.
            turns: The clients of the fit.
            first: The first client's loader, id and optimiser state (restored before its first step).
            keep: Capture each client's optimiser state at its end.
            step: Trains turn ``i``'s client.
            starts: A callback whose ``on_train_batch_start`` switches to each turn's client.
        """
        trainer = self.trainer
        loader, client_id, optimizer_state = first
        self._prepare(loader, client_id, 1, optimizer_state, keep)
        automatic = module.automatic_optimization
        # An instance attribute shadows the class's training_step for this fit only: Lightning calls the module's
        # training_step by name, and the module's own one stays what ``step`` calls for each local batch.
        module.training_step = step
        module.automatic_optimization = False
        trainer.callbacks.append(starts)
        try:
            # Its own generator: each iterator of a loader without one draws a seed from torch's global generator,
            # and Lightning makes one iterator in a Trainer's first fit and two in every later fit, so a resumed run
            # (a fresh Trainer) would be a draw behind where training draws from it too (dropout, augmentation).
            turns_loader = DataLoader(range(turns), batch_size=None, generator=torch.Generator())
            trainer.fit(module, train_dataloaders=turns_loader)
        finally:
            trainer.callbacks.remove(starts)
            del module.training_step
            module.automatic_optimization = automatic

    def restart_optimizer(
        self, loader: DataLoader, client_id: str, optimizer_state: dict[str, Any] | None, keep: bool
    ) -> None:
        """A fresh optimiser from ``configure_optimizers`` for the next client of a round fit, its state restored.

        As at the start of a fit of its own: the strategy builds the optimiser (and schedulers) from the module,
        and the probe restores the client's kept state (``optimizer_state``) in ``on_train_start``.
        """
        self._warn_if_unreproducible(loader, client_id)
        self.trainer.strategy.setup_optimizers(self.trainer)
        self._arm_probe(optimizer_state, keep)

    def _prepare(
        self, loader: DataLoader, client_id: str, epochs: int, optimizer_state: dict[str, Any] | None, keep: bool
    ) -> None:
        """Before a ``trainer.fit``: its epoch budget raised by ``epochs``, the probe armed for the first client."""
        trainer = self.trainer
        self._warn_if_unreproducible(loader, client_id)
        trainer.fit_loop.max_epochs = trainer.current_epoch + epochs
        trainer.should_stop = False
        self._arm_probe(optimizer_state, keep)

    def _arm_probe(self, optimizer_state: dict[str, Any] | None, keep: bool) -> None:
        probe = self.probe
        probe.pending_optimizer_state = optimizer_state
        probe.capture_optimizer_state = keep
        probe.captured_optimizer_state = None

    def check_ran(self, ran: int, epochs: int, loader: DataLoader, client_id: str) -> None:
        """Check the batches one client's training ran (``epochs`` passes over ``loader`` were asked for).

        Raises:
            RuntimeError: If it ran no batch at all.
        """
        if ran == 0:
            raise RuntimeError(
                f"the local fit of client {client_id!r} ran no training batch (its loader is empty or the "
                f"Trainer's limits, e.g. trainer.limit_train_batches, stopped it)"
            )
        expected = epochs * len(loader)
        if ran != expected and self.trainer.limit_train_batches == 1.0:
            warnings.warn(f"client {client_id!r} ran {ran} batches, expected {expected}", stacklevel=3)

    def _warn_if_unreproducible(self, loader: DataLoader, client_id: str) -> None:
        """Warn once when a training loader shuffles with torch's ``RandomSampler``.

        Its shuffling state is not in the round checkpoints (a resumed run sees other batches), and
        Lightning draws one extra permutation from it per ``trainer.fit`` after the first.
        """
        if self._warned_random_sampler or not isinstance(getattr(loader, "sampler", None), RandomSampler):
            return
        self._warned_random_sampler = True
        warnings.warn(
            f"the training loader of client {client_id!r} shuffles with torch's RandomSampler: its state is not "
            "saved in round checkpoints (a resumed run sees other batches) and Lightning draws an extra "
            "permutation from it on every fit after the first. Use datamodules.sampler.SeededEpochSampler "
            "(as the built-in datamodules do) for batches that depend only on (seed, client, pass).",
            stacklevel=3,
        )
