"""Round-level logging to the Trainer's loggers (W&B by default, CSV/TensorBoard as alternatives)."""

from __future__ import annotations

import math
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger, WandbLogger

from fl_lightning.wandb_sync import record_part, resume_message

# Round-level metric families; on W&B each is plotted against "round", not the shared Trainer's step.
ROUND_PREFIXES = ("eval", "client", "time", "throughput", "round")


class WandbOfflineResumeWarning(UserWarning):
    """A resumed offline W&B run: its parts must be uploaded together (:mod:`fl_lightning.wandb_sync`)."""


class RoundTracker:
    """Sends round-level metrics and the resolved config to every logger of the shared Trainer.

    W&B specifics: the run's files go into the run directory unless the user chose a ``save_dir``
    other than the default ``.``;
    ``round`` is declared the x-axis of every round-level key (``eval/*``, ``client/*``, ``time/*``,
    ``throughput/*``, ``round/*``), so per-client curves (``client/<id>/train/loss``) neither overlap
    nor restart; a resumed run continues the same W&B run id (offline, in a new ``offline-run-*`` directory: the
    tracker lists each in :data:`fl_lightning.wandb_sync.RECORD` and, at a resume, warns with the command that
    uploads the parts as one run). An offline W&B run is opened in a background
    thread (its service takes ≈ 1–2 s to start, time the first round uses instead); the first call that needs it
    waits for it and raises what opening it raised. An online run opens before the first round, so a login or
    network error stops the run before any training.

    Args:
        loggers: The Trainer's loggers (may be empty).

    """

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = list(loggers)
        self._defined: dict[int, set[str]] = {}  # per W&B logger: keys given "round" as their x-axis by name
        self._opening: dict[int, _Opening] = {}  # per W&B logger being opened in the background

    @classmethod
    def take_from(cls, trainer: Trainer) -> RoundTracker:
        """A tracker of the Trainer's loggers, which the Trainer then gives up.

        Metrics reach the loggers per round through the tracker only; a Trainer that kept them would open the W&B
        run at every client fit's setup (Lightning's ``_call_setup_hook``), racing the background opening, and
        warn once per client that its epoch has fewer batches than ``log_every_n_steps`` (advice that cannot be
        acted on: nothing is logged per step).
        """
        tracker = cls(trainer.loggers)
        trainer.loggers = []
        return tracker

    def start(self, run_dir: Path, config: dict[str, Any] | None, run_id: str | None = None) -> None:
        """Open the experiments (continuing ``run_id`` on W&B) and log the config once."""
        config = config if run_id is None else None  # a resumed run logged its config already
        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                if run_id is not None and _offline(logger):
                    # W&B writes another offline directory with the same id; its end-of-run hint names only
                    # that one, and syncing it alone (or before the first) scrambles the history (wandb_sync.py).
                    warnings.warn(resume_message(run_dir, run_id), WandbOfflineResumeWarning, stacklevel=2)
                opening = _Opening(logger, run_dir, run_id, config)
                if logger._offline:
                    self._opening[id(logger)] = opening
                    opening.start()
                else:
                    opening.run()
                    opening.result()
            elif config is not None:
                logger.log_hyperparams(config)

    def _wait(self, logger: Logger, raise_error: bool = True) -> None:
        """Wait for the logger's background opening, if any, and raise what it raised (unless told not to)."""
        opening = self._opening.pop(id(logger), None)
        if opening is not None:
            opening.join()
            if raise_error:
                opening.result()

    def _wandb(self, logger: WandbLogger) -> Any:
        """The logger's W&B run, once it is open."""
        self._wait(logger)
        return logger.experiment

    def log_round(
        self, round_idx: int, metrics: dict[str, float], clients: tuple[list[str], list[list[Any]]] | None = None
    ) -> None:
        """Log one round's metrics with the round (1-based) as the step.

        Args:
            round_idx: The round (1-based).
            metrics: Round-level metrics (:func:`fl_lightning.outputs.records.logged_metrics`).
            clients: With many clients, the round's per-client metrics as one table (columns, rows; see
                :func:`fl_lightning.outputs.records.client_table`) instead of per-client keys in ``metrics``. W&B gets a
                histogram of each metric over the clients (``clients/<metric>``) and, on evaluation rounds, the
                table itself (``clients/table``); other loggers take no tables (``metrics.csv`` has every row).
        """
        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                logged = {**metrics, **(client_media(*clients) if clients and clients[1] else {})}
                # WandbLogger's own glob "*" (x-axis trainer/global_step) also matches these keys, and W&B picks
                # one matching glob at random; a definition by exact name takes precedence over every glob.
                defined = self._defined.setdefault(id(logger), set())
                experiment = self._wandb(logger)
                for key in sorted(logged.keys() - defined):
                    experiment.define_metric(key, step_metric="round")
                defined.update(logged)
                experiment.log({**logged, "round": round_idx})
            else:
                logger.log_metrics(metrics, step=round_idx)

    def finish(self, status: str = "success") -> None:
        """Flush and close every logger."""
        for logger in self.loggers:
            self._wait(logger, raise_error=status == "success")  # a failed run's own error matters more
            logger.finalize(status)
            if isinstance(logger, WandbLogger) and logger._experiment is not None:
                logger.experiment.finish()
                logger._experiment = None

    def run_id(self) -> str | None:
        """The W&B run id (what a checkpoint stores to continue the same run), if any."""
        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                self._wait(logger)
                return logger.version
        return None


CLIENT_TABLE_KEY = "clients/table"


def client_media(columns: list[str], rows: list[list[Any]]) -> dict[str, Any]:
    """W&B objects for a round's per-client table: a histogram per numeric column, the table on evaluation rounds.

    Args:
        columns: ``client`` then the metric columns.
        rows: One row per client (None where a client has no value).

    Returns:
        ``{"clients/<metric>": wandb.Histogram, "clients/table": wandb.Table}`` (the table only when a column is
        an evaluation metric).
    """
    import wandb  # only runs that log to W&B import it, and only once the logger is in use

    out: dict[str, Any] = {}
    for j, column in enumerate(columns[1:], start=1):
        values = [v for v in (row[j] for row in rows) if isinstance(v, (int, float)) and math.isfinite(v)]
        if values:
            out[f"clients/{column}"] = wandb.Histogram(values)
    if any(c.startswith("eval/") for c in columns):
        out[CLIENT_TABLE_KEY] = wandb.Table(columns=columns, data=rows)
    return out


class _Opening(threading.Thread):
    """Opens one W&B run (init arguments, the "round" x-axis, the config) and keeps what it raised.

    Args:
        logger: The W&B logger.
        run_dir: The run directory (W&B's files go there unless the user chose a ``save_dir``).
        run_id: The W&B run id to continue (a resumed run), or None.
        config: The resolved config to log, or None.

    """

    def __init__(self, logger: WandbLogger, run_dir: Path, run_id: str | None, config: dict[str, Any] | None):
        super().__init__(name="wandb-open", daemon=True)
        self.logger, self.run_dir, self.run_id, self.config = logger, run_dir, run_id, config
        self.error: BaseException | None = None

    def run(self) -> None:
        """Open the run; an error is kept for :meth:`result` (a thread's exception would only be printed)."""
        try:
            _prepare_wandb(self.logger, self.run_dir, self.run_id)
            _record_offline_part(self.logger, self.run_dir)
            if self.config is not None:
                self.logger.log_hyperparams(self.config)
        except BaseException as err:  # noqa: BLE001 - re-raised in the thread that waits for the run
            self.error = err

    def result(self) -> None:
        """Raise what opening the run raised, if anything."""
        if self.error is not None:
            raise self.error


def _prepare_wandb(logger: WandbLogger, run_dir: Path, run_id: str | None) -> None:
    # WandbLogger creates its run lazily on first use, so its init arguments can still be set here.
    if logger._experiment is None:
        # WandbLogger passes anonymous=None to wandb.init, which W&B answers on every run with "The anonymous
        # setting has no effect and will be removed"; leaving the key out keeps W&B's default, without the line.
        if logger._wandb_init.get("anonymous") is None:
            logger._wandb_init.pop("anonymous", None)
        if logger._wandb_init.get("dir") in (None, "."):  # WandbLogger's default save_dir is "."
            logger._wandb_init["dir"] = str(run_dir)
            logger._save_dir = str(run_dir)
        if run_id is not None:
            logger._wandb_init.update(id=run_id, resume="allow")
            logger._id = run_id
    experiment = logger.experiment
    experiment.define_metric("round")
    for prefix in ROUND_PREFIXES:
        experiment.define_metric(f"{prefix}/*", step_metric="round")


def _offline(logger: WandbLogger) -> bool:
    """Whether the logger's run will be offline (its own flag, or W&B's ``WANDB_MODE``), before it is opened."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    return mode != "disabled" and (logger._offline or mode in ("offline", "dryrun"))


def _record_offline_part(logger: WandbLogger, run_dir: Path) -> None:
    """List an opened offline run's transaction log in the run directory, for ``python -m fl_lightning.wandb_sync``.

    The record finds a part also where the user's ``save_dir`` put it, and tells a deleted part from one never
    written; the helper still finds parts in ``<run dir>/wandb`` without it.
    """
    experiment = logger._experiment
    if experiment is None or not getattr(experiment, "offline", False):  # disabled, online, or an old wandb
        return
    record_part(run_dir, Path(experiment.settings.sync_file), experiment.id)
