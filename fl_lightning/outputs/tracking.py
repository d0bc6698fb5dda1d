"""Round-level logging to the Trainer's loggers (W&B by default, CSV/TensorBoard as alternatives)."""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger, WandbLogger

from fl_lightning.outputs import tracked_rounds
from fl_lightning.outputs.wandb_init import is_offline, wandb_init_args
from fl_lightning.tools.wandb_sync import SyncRefused, logged_rounds, record_part, resume_message

# Round-level metric families; on W&B each is plotted against "round", not the shared Trainer's step.
ROUND_PREFIXES = ("eval", "client", "time", "throughput", "round")


class WandbOfflineResumeWarning(UserWarning):
    """A resumed offline W&B run: its parts must be uploaded together (:mod:`fl_lightning.tools.wandb_sync`)."""


@dataclass(frozen=True)
class WandbArgs:
    """A W&B run as the config describes it: the arguments of its ``WandbLogger`` (``trainer.logger.init_args``).

    The round tracker opens the run itself (:func:`~fl_lightning.outputs.wandb_init.wandb_init_args`), in the run
    directory and, on a resume, continuing the checkpoint's W&B run id.
    """

    init_args: dict[str, Any]


Tracked = Logger | WandbArgs


class RoundTracker:
    """Sends round-level metrics and the resolved config to every logger of the shared Trainer.

    W&B: a ``WandbLogger`` given in the config (the default) is opened by the tracker with ``wandb.init`` from the
    logger's arguments (:class:`WandbArgs`); its files go into the run directory unless the user chose a
    ``save_dir`` other than the default ``.``, and a resumed run continues the same W&B run id (offline, in a new
    ``offline-run-*`` directory: the tracker lists each in :data:`fl_lightning.tools.wandb_sync.RECORD` and, at a
    resume, warns with the command that uploads the parts as one run). A ``WandbLogger`` object built in Python
    is used as it is (its ``experiment``): its own folder and id (a resume warns unless its id is the run's).
    ``round`` is declared the x-axis of every round-level key (``eval/*``, ``client/*``, ``time/*``,
    ``throughput/*``, ``round/*``), so per-client curves (``client/<id>/train/loss``) neither overlap nor restart.
    With an offline W&B run from the config, every round's logged metrics are also recorded in the run directory
    (:mod:`fl_lightning.outputs.tracked_rounds`); a resume first logs again, from that record, the rounds the
    checkpoint counts as done but no earlier offline part holds (a ``SIGKILL`` loses the end of W&B's file), so the
    uploaded history has every round of ``rounds.csv`` once.
    An offline W&B run from the config is opened in a background thread (its service takes ≈ 1–2 s to start,
    time the first round uses instead); the first call that needs it waits for it and raises what opening it
    raised. An online run opens before the first round, so a login or network error stops the run before any
    training.

    Args:
        loggers: The loggers (may be empty): Lightning loggers, or :class:`WandbArgs` for W&B runs to open.

    """

    def __init__(self, loggers: list[Tracked]) -> None:
        self.loggers = list(loggers)
        self._defined: dict[int, set[str]] = {}  # per W&B run: keys given "round" as their x-axis by name
        self._opening: dict[int, _Opening] = {}  # per W&B logger: its opening (background or done)
        self._journal: Path | None = None  # the run directory, when an offline W&B run's rounds are recorded there
        self._replay: dict[int, list[dict[str, Any]]] = {}  # per W&B logger: recorded rounds it lost, to log again

    @classmethod
    def take_from(cls, trainer: Trainer, logger_config: Any = None) -> RoundTracker:
        """A tracker of the Trainer's loggers, which the Trainer then gives up.

        Args:
            trainer: The shared Trainer.
            logger_config: ``trainer.logger`` of the resolved config (a class spec, a list of them, a bool or None):
                a ``WandbLogger`` named there becomes :class:`WandbArgs` (opened by the tracker), matched to the
                Trainer's loggers by position.

        Metrics reach the loggers per round through the tracker only; a Trainer that kept them would open the W&B
        run at every client fit's setup (Lightning's ``_call_setup_hook``), racing the background opening, and
        warn once per client that its epoch has fewer batches than ``log_every_n_steps`` (advice that cannot be
        acted on: nothing is logged per step).
        """
        specs = logger_config if isinstance(logger_config, list) else [logger_config]
        loggers: list[Tracked] = list(trainer.loggers)
        if len(specs) == len(loggers):
            loggers = [_from_spec(spec, logger) for spec, logger in zip(specs, loggers)]
        trainer.loggers = []
        return cls(loggers)

    def start(
        self, run_dir: Path, config: dict[str, Any] | None, run_id: str | None = None, done_rounds: int = 0
    ) -> None:
        """Open the experiments (continuing ``run_id`` on W&B) and log the config once.

        Args:
            run_dir: The run directory.
            config: The resolved config.
            run_id: The W&B run id to continue (a resumed run), or None.
            done_rounds: The rounds the resumed checkpoint counts as done (0 for a new run).
        """
        config = config if run_id is None else None  # a resumed run logged its config already
        offline = [lg for lg in self.loggers if isinstance(lg, WandbArgs) and is_offline(lg.init_args)]
        if offline:
            self._journal = Path(run_dir)
            if run_id is not None:
                recorded = tracked_rounds.cut_back(run_dir, done_rounds)
                self._replay = {id(lg): _lost_rounds(run_dir, done_rounds, recorded) for lg in offline}
        for logger in self.loggers:
            if isinstance(logger, (WandbArgs, WandbLogger)):
                if run_id is not None and isinstance(logger, WandbArgs) and is_offline(logger.init_args):
                    # W&B writes another offline directory with the same id; its end-of-run hint names only
                    # that one, and syncing it alone (or before the first) scrambles the history (wandb_sync.py).
                    warnings.warn(resume_message(run_dir, run_id), WandbOfflineResumeWarning, stacklevel=2)
                if run_id is not None and isinstance(logger, WandbLogger) and logger.version != run_id:
                    warnings.warn(
                        f"the WandbLogger built in Python continues W&B run {logger.version!r}, not the resumed "
                        f"run's {run_id!r}: give it id={run_id!r} (or name it in the config, trainer.logger)",
                        stacklevel=2,
                    )
                opening = self._opening[id(logger)] = _Opening(logger, run_dir, run_id, config)
                if isinstance(logger, WandbArgs) and is_offline(logger.init_args):
                    opening.start()
                else:
                    opening.run()
                    opening.result()
            elif config is not None:
                logger.log_hyperparams(config)

    def _wandb(self, logger: Tracked, raise_error: bool = True) -> Any:
        """The logger's W&B run once it is open (waiting for a background opening); raises what opening raised."""
        opening = self._opening.get(id(logger))
        if opening is None:
            return None
        if opening.is_alive():
            opening.join()
        if raise_error:
            opening.result()
        return opening.experiment

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
        if self._journal is not None:
            tracked_rounds.append(self._journal, round_idx, metrics, list(clients) if clients else None)
        for logger in self.loggers:
            if isinstance(logger, (WandbArgs, WandbLogger)):
                self._log_again(logger)
                self._log_wandb(logger, round_idx, metrics, clients)
            else:
                logger.log_metrics(metrics, step=round_idx)

    def _log_wandb(
        self,
        logger: Tracked,
        round_idx: int,
        metrics: dict[str, float],
        clients: tuple[list[str], list[list[Any]]] | None,
    ) -> None:
        logged = {**metrics, **(client_media(*clients) if clients and clients[1] else {})}
        # WandbLogger's own glob "*" (x-axis trainer/global_step) also matches these keys, and W&B picks
        # one matching glob at random; a definition by exact name takes precedence over every glob.
        defined = self._defined.setdefault(id(logger), set())
        experiment = self._wandb(logger)
        for key in sorted(logged.keys() - defined):
            experiment.define_metric(key, step_metric="round")
        defined.update(logged)
        experiment.log({**logged, "round": round_idx})

    def _log_again(self, logger: Tracked) -> None:
        """Log the recorded rounds this resumed W&B run lost (once, before its first new row)."""
        for entry in self._replay.pop(id(logger), []):
            self._log_wandb(logger, entry["round"], entry["metrics"], entry["clients"])

    def log_final(self, metrics: dict[str, float], round_idx: int) -> None:
        """Log the end-of-run test metrics (a run with a validation split reads its test sets once, at the end).

        W&B gets them in the run's summary (its rounds' history holds validation metrics only); other loggers
        at the last round's step.
        """
        for logger in self.loggers:
            if isinstance(logger, (WandbArgs, WandbLogger)):
                self._wandb(logger).summary.update(metrics)
            else:
                logger.log_metrics(metrics, step=round_idx)

    def finish(self, status: str = "success") -> None:
        """Flush and close every logger (a W&B run this tracker opened is finished, with exit code 1 if failed)."""
        for logger in self.loggers:
            if id(logger) in self._replay and self._wandb(logger, raise_error=False) is not None:
                self._log_again(logger)  # a resume that ran no new round still mends the history
            experiment = self._wandb(logger, raise_error=status == "success")  # a failed run's own error matters more
            if isinstance(logger, Logger):
                logger.finalize(status)
            if experiment is not None and self._opening.pop(id(logger)).opened:
                experiment.finish(exit_code=0 if status == "success" else 1)

    def run_id(self) -> str | None:
        """The W&B run id (what a checkpoint stores to continue the same run), if any."""
        for logger in self.loggers:
            experiment = self._wandb(logger)
            if experiment is not None:
                return experiment.id
        return None


def _lost_rounds(run_dir: Path, done_rounds: int, recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded calls of the rounds a resumed offline run must log again (``rounds_to_log_again``).

    Warns when the earlier parts cannot be read, or when a lost round has no record (a run started before the
    record existed): W&B's history then lacks those rounds, and ``wandb_sync --dry-run`` names them.
    """
    try:
        rounds = tracked_rounds.rounds_to_log_again(logged_rounds(run_dir), done_rounds)
    except SyncRefused as err:
        warnings.warn(f"W&B resume: the earlier offline parts cannot be read ({err}); no lost round is logged again",
                      stacklevel=3)  # fmt: skip
        return []
    unrecorded = sorted(set(rounds) - {e["round"] for e in recorded})
    if unrecorded:
        warnings.warn(
            f"W&B resume: rounds {unrecorded} are done (rounds.csv) but in no offline W&B part and not in "
            f"{tracked_rounds.JOURNAL} (the run started before it existed): W&B's history will lack them",
            stacklevel=3,
        )
    return [e for e in recorded if e["round"] in rounds]


def _from_spec(spec: Any, logger: Logger) -> Tracked:
    """The Trainer's ``logger`` as the tracker keeps it: :class:`WandbArgs` where ``spec`` names a WandbLogger."""
    if isinstance(logger, WandbLogger) and isinstance(spec, dict) and spec.get("class_path") in WANDB_CLASS_PATHS:
        return WandbArgs({**(spec.get("init_args") or {}), **(spec.get("dict_kwargs") or {})})
    return logger


# The class paths of Lightning's own WandbLogger (a subclass of it is used as built: it may change what it does).
WANDB_CLASS_PATHS = ("lightning.pytorch.loggers.WandbLogger", "lightning.pytorch.loggers.wandb.WandbLogger")


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
    """Opens one W&B run (init arguments, the "round" x-axis, the config) and keeps it, or what it raised.

    Args:
        logger: The W&B run's arguments, or a ``WandbLogger`` built in Python (its ``experiment`` is used).
        run_dir: The run directory (W&B's files go there unless the user chose a ``save_dir``).
        run_id: The W&B run id to continue (a resumed run), or None.
        config: The resolved config to log, or None.

    """

    def __init__(
        self, logger: WandbArgs | WandbLogger, run_dir: Path, run_id: str | None, config: dict[str, Any] | None
    ):
        super().__init__(name="wandb-open", daemon=True)
        self.logger, self.run_dir, self.run_id, self.config = logger, run_dir, run_id, config
        self.experiment: Any = None
        self.opened = False  # whether the run is this tracker's to finish (not a Python-built logger's)
        self.error: BaseException | None = None

    def run(self) -> None:
        """Open the run; an error is kept for :meth:`result` (a thread's exception would only be printed)."""
        try:
            self.experiment, self.opened = _open_wandb(self.logger, self.run_dir, self.run_id)
            _record_offline_part(self.experiment, self.run_dir)
            if self.config is not None:
                self.experiment.config.update(self.config, allow_val_change=True)
        except BaseException as err:  # noqa: BLE001 - re-raised in the thread that waits for the run
            self.error = err

    def result(self) -> None:
        """Raise what opening the run raised, if anything."""
        if self.error is not None:
            raise self.error


def _open_wandb(logger: WandbArgs | WandbLogger, run_dir: Path, run_id: str | None) -> tuple[Any, bool]:
    """The open W&B run with "round" declared the x-axis of the round-level keys; True if opened here."""
    if isinstance(logger, WandbArgs):
        import wandb

        experiment, opened = wandb.init(**wandb_init_args(logger.init_args, run_dir, run_id)), True
    else:
        experiment, opened = logger.experiment, False
    experiment.define_metric("round")
    for prefix in ROUND_PREFIXES:
        experiment.define_metric(f"{prefix}/*", step_metric="round")
    return experiment, opened


def _record_offline_part(experiment: Any, run_dir: Path) -> None:
    """List an opened offline run's transaction log in the run directory, for ``fl_lightning.tools.wandb_sync``.

    The record finds a part also where the user's ``save_dir`` put it, and tells a deleted part from one never
    written; the helper still finds parts in ``<run dir>/wandb`` without it.
    """
    if not getattr(experiment, "offline", False):  # disabled, online, or an old wandb
        return
    record_part(run_dir, Path(experiment.settings.sync_file), experiment.id)
