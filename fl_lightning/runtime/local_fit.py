"""One client's local training on the shared Trainer: the step a distributed backend would replace."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
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


class LocalFitter:
    """Runs ``trainer.fit`` for one client at a time on ONE Trainer.

    Lightning's fit loop stops once ``current_epoch`` reaches ``max_epochs``, so a second
    ``fit`` would silently do nothing; before each fit the budget is raised by the client's local
    epochs, and after it the number of batches actually run is checked. Every client's training is one
    ``trainer.fit`` of its own, through Lightning's public API only, so every hook (a user's callback's
    included) runs per client exactly as Lightning documents it for one fit.

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
        self.trainer = trainer
        self._warned_loader = False
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

    def _prepare(
        self, loader: DataLoader, client_id: str, epochs: int, optimizer_state: dict[str, Any] | None, keep: bool
    ) -> None:
        """Before a ``trainer.fit``: its epoch budget raised by ``epochs``, the probe armed for the client."""
        trainer = self.trainer
        self._warn_if_unreproducible(loader, client_id)
        trainer.fit_loop.max_epochs = trainer.current_epoch + epochs
        trainer.should_stop = False
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
        """Warn once when a training loader's randomness is not a function of (seed, client, round).

        Two causes: torch's ``RandomSampler`` (its shuffling state is not in the round checkpoints, so a resumed
        run sees other batches, and Lightning draws an extra permutation from it per ``trainer.fit`` after the
        first), and a loader without a ``generator`` of its own (each ``iter()`` then draws a base seed from torch's
        global generator, and Lightning iterates once on a Trainer's first fit but twice on later ones, so the
        dropout masks and random transforms of a client differ between one process, ranks and a resumed run).
        """
        if self._warned_loader or not isinstance(loader, DataLoader):
            return
        problems = []
        if isinstance(loader.sampler, RandomSampler):
            problems.append(
                "shuffles with torch's RandomSampler: its state is not saved in round checkpoints (a resumed run "
                "sees other batches) and Lightning draws an extra permutation from it on every fit after the first"
            )
        if loader.generator is None:
            problems.append(
                "has no generator of its own: each iter() draws from torch's global generator, and Lightning "
                "iterates once on a Trainer's first fit but twice on later ones, so dropout masks and random "
                "transforms differ between one process, ranks and a resumed run"
            )
        if not problems:
            return
        self._warned_loader = True
        warnings.warn(
            f"the training loader of client {client_id!r} " + "; it ".join(problems) + ". Build it as the "
            "built-in datamodules do: datamodules.sampler.SeededEpochSampler (batches that depend only on "
            "(seed, client, pass)) and DataLoader(..., generator=datamodules.base.loader_generator(seed, client)).",
            stacklevel=3,
        )
