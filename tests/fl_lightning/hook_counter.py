"""A user's own Lightning callback, as a user would write it: counts the hooks Lightning documents per fit.

Given to a run as ``--trainer.callbacks+=tests.fl_lightning.hook_counter.HookCounter``; every fit it sees is recorded
in :data:`FITS`, so a test can check that each client's training is one ``trainer.fit`` with Lightning's hook order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning as L
from typing_extensions import override


@dataclass
class FitRecord:
    """What one ``trainer.fit`` called, in Lightning's terms."""

    fit_starts: int = 0
    train_starts: int = 0
    train_ends: int = 0
    epochs_planned: int = 0  # trainer.max_epochs - trainer.current_epoch when the fit started
    epoch_starts: int = 0
    epoch_ends: int = 0
    batch_starts: int = 0
    batches_planned: int = 0  # trainer.num_training_batches summed over the fit's epochs
    batch_indices: list[list[int]] = field(default_factory=list)  # per epoch, batch_idx as the hooks saw it


FITS: list[FitRecord] = []


class HookCounter(L.Callback):
    """Counts ``on_fit_start``, ``on_train_start``, ``on_train_epoch_*``, ``on_train_batch_start``, ``on_train_end``."""

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        FITS.append(FitRecord(fit_starts=1, epochs_planned=trainer.max_epochs - trainer.current_epoch))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        FITS[-1].train_starts += 1

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = FITS[-1]
        record.epoch_starts += 1
        record.batches_planned += int(trainer.num_training_batches)
        record.batch_indices.append([])

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        FITS[-1].batch_starts += 1
        FITS[-1].batch_indices[-1].append(batch_idx)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        FITS[-1].epoch_ends += 1

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        FITS[-1].train_ends += 1


def check_fits(fits: list[FitRecord]) -> None:
    """Assert that every recorded fit ran its hooks as Lightning documents them for one ``trainer.fit``."""
    assert fits, "the user's callback saw no fit"
    for i, fit in enumerate(fits):
        where = f"fit {i}: {fit}"
        assert fit.fit_starts == fit.train_starts == fit.train_ends == 1, where
        assert fit.epoch_starts == fit.epoch_ends == fit.epochs_planned >= 1, where
        assert fit.batch_starts == fit.batches_planned >= fit.epoch_ends, where
        assert all(indices == list(range(len(indices))) for indices in fit.batch_indices), where
