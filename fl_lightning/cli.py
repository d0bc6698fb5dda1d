"""``python train.py --config configs/<experiment>.yaml``: LightningCLI builds model, data, Trainer and federation."""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from datamodules.base import FederatedDataModule
from fl_lightning.clients.base import ClientModule
from fl_lightning.config import DATA_SHAPE_LINKS, FederationConfig
from fl_lightning.engines import distributed, local_ranks
from fl_lightning.engines.local import local_federation
from fl_lightning.errors import MissingExtra, PreconditionError
from fl_lightning.ops.rng import rng_state, set_rng_state
from fl_lightning.runtime import ClientRuntime
from fl_lightning.server.federation import Federation
from fl_lightning.startup.extras import missing_extra

# main() passes the command line to LightningCLI itself (the ranks and the serialized runtime add to it): intended.
warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")

# The shared Trainer trains every client in turn; these are the settings that make that correct and quiet.
TRAINER_DEFAULTS: dict[str, Any] = {
    # W&B offline by default: no account needed; the run's files go into the run directory.
    # Opt in to online logging with --trainer.logger.init_args.offline=false.
    "logger": {
        "class_path": "lightning.pytorch.loggers.WandbLogger",
        "init_args": {"offline": True, "project": "fl_lightning"},
    },
    "enable_autolog_hparams": False,  # the Federation logs the resolved config once, not once per client fit
    "enable_checkpointing": False,  # rounds are checkpointed by the Federation, not per client fit
    "enable_progress_bar": False,  # per-client epoch bars would flood the terminal; the Federation shows rounds
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "max_epochs": 0,  # raised by each client's local budget
    "accelerator": "auto",
    "devices": 1,
}


class FederatedCLI(LightningCLI):
    """LightningCLI with a ``federation:`` section and the data's shape linked into the model.

    Where the run has ranks, the parsed config decides, however it was given (YAML, ``--key value`` or
    ``--key=value``): with ``launch_argv`` and ``federation.workers`` > 1 outside a rank, this process starts the
    other local ranks and becomes rank 0 (:func:`~fl_lightning.engines.local_ranks.start`); on a rank with CUDA, the
    Trainer's device is this rank's GPU (``federation.workers_per_device``).

    Args:
        launch_argv: The run's arguments, to start the other local ranks with; None never starts any.
        *args: LightningCLI's arguments.
        **kwargs: LightningCLI's keyword arguments.

    Attributes:
        rank: ``(rank, world size, local rank)`` on a rank of a distributed run, else None.
        ranks: The local ranks this process started (it is their rank 0), else None.
    """

    def __init__(self, *args: Any, launch_argv: list[str] | None = None, **kwargs: Any) -> None:
        self.launch_argv = launch_argv
        self.rank: tuple[int, int, int] | None = None
        self.ranks: local_ranks.RankGroup | None = None
        super().__init__(*args, **kwargs)  # parses, then instantiates (before_instantiate_classes in between)

    def before_instantiate_classes(self) -> None:
        """Start the local ranks the config asks for; on a rank, prepare the Trainer it is about to build.

        On a rank, its variables are hidden from Lightning and a CUDA rank gets its GPU (:func:`rank_devices`).
        """
        workers = self.config.federation.workers
        if self.launch_argv is not None and workers > 1 and distributed.environment_rank() is None:
            self.ranks = local_ranks.start(self.launch_argv, workers)
        self.rank = distributed.environment_rank()
        if self.rank is not None:
            distributed.hide_elastic_environment()  # the Trainer must stay a single-device Trainer
            devices = rank_devices(self.config, self.rank[2], torch.cuda.is_available())
            if devices is not None:
                self.config.trainer.devices = devices

    def instantiate_classes(self) -> None:
        """LightningCLI's instantiation; should it fail after the local ranks started, they are stopped first."""
        try:
            super().instantiate_classes()
        except BaseException:
            if self.ranks is not None:  # the ranks fail the same way; without this the watcher would end us
                self.ranks.close(ok=False)
            raise

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add the federation settings and link ``data.{num_classes,in_channels,image_size,num_features}`` → ``model``.

        A link whose target the model class does not take is left out (an image client takes no ``num_features``,
        a table's client no ``image_size``).
        """
        parser.add_class_arguments(FederationConfig, "federation")
        for attr in DATA_SHAPE_LINKS:
            parser.link_arguments(f"data.{attr}", f"model.init_args.{attr}", apply_on="instantiate")
        parser.set_defaults(
            {
                "model": {"class_path": "fl_lightning.clients.ClassificationClient"},
                "data": {"class_path": "datamodules.DigitsFederated"},
            }
        )


def build_cli(args: list[str] | None = None, log: bool = True, launch: bool = False) -> FederatedCLI:
    """Parse ``args`` (or ``sys.argv``) and instantiate everything; errors name the offending key.

    ``log=False`` (a Flower site, which logs nothing) makes "no logger" the Trainer's default: resolving the
    default W&B logger's type hints imports ``wandb``, even when ``--trainer.logger=false`` follows.
    ``launch=True`` (the run's own build in :func:`main`) starts the local ranks ``federation.workers`` asks for.
    """
    return FederatedCLI(
        launch_argv=(sys.argv[1:] if args is None else list(args)) if launch else None,
        model_class=ClientModule,
        datamodule_class=FederatedDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=args,
        trainer_defaults=TRAINER_DEFAULTS if log else {**TRAINER_DEFAULTS, "logger": False},
        save_config_callback=None,  # the Federation writes the resolved config into the run directory
        seed_everything_default=0,
        auto_configure_optimizers=False,
        parser_kwargs={"description": "Federated learning on non-IID data with one shared Lightning Trainer."},
    )


_UNION_DUMP = "Does not validate against any of the Union subtypes"
# The config section each base class of a union is instantiated for (the dump names the class, not the key).
_SECTIONS = {"FederatedDataModule": "data", "ClientModule": "model", "Callback": "trainer.callbacks"}


def instantiation_error_message(err: BaseException) -> str | None:
    """The user's own error out of jsonargparse's union dump, or None when ``err`` is not such a dump.

    A class argument such as ``data`` or ``model`` is a union (the class or None); when its constructor raises
    (``alpha must be > 0, got -1.0``), jsonargparse reports every subtype's failure and the whole namespace,
    and the one line that matters is lost among them. This returns ``data (datamodules.DigitsFederated): alpha
    must be > 0, got -1.0``.
    """
    text = str(err)
    if _UNION_DUMP not in text:
        return None
    errors, in_errors = [], False
    for line in text.splitlines():
        if line.startswith("Errors:"):
            in_errors = True
        elif in_errors and line.startswith("  - "):
            errors.append(line[4:].strip())
        elif in_errors and not line.startswith("    "):  # the end of the list (continuation lines are indented)
            in_errors = False
    # The other subtypes' failures (None, a list instead of one callback...) only say the value is not of them.
    own = [e for e in errors if not e.startswith(("Expected a <class", "Not a valid subclass of"))]
    errors = own or errors
    if not errors:
        return None
    subtypes = next((line for line in text.splitlines() if line.startswith("Subtypes:")), "")
    section = next((key for base, key in _SECTIONS.items() if re.search(rf"\b{base}\b", subtypes)), "config")
    class_path = re.search(r"class_path='([^']+)'", text)
    where = f"{section} ({class_path.group(1)})" if class_path else section
    return f"invalid {where}: {'; '.join(errors)}"


def main(args: list[str] | None = None) -> dict[str, Any]:
    """Entry point of ``train.py``; tests call it with an argument list.

    Under ``torchrun`` (the ``RANK``/``WORLD_SIZE`` variables) this process is one rank of a distributed run;
    with ``--federation.workers=N`` it starts N ranks on this machine and waits for them.

    Returns:
        The final summary (also written to ``summary.json`` in the run directory); ``{}`` on ranks other than 0.

    """
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    # W&B's own end-of-run printout repeats what our final table shows; the run directory says where its files are.
    os.environ.setdefault("WANDB_SILENT", "true")
    argv = sys.argv[1:] if args is None else list(args)
    started = distributed.environment_rank()
    extra = ["--trainer.logger=false"] if started is not None and started[0] != 0 else []  # outputs from rank 0 only
    cli = _build([*argv, *extra], launch=started is None)  # may start the local ranks and make this rank 0
    if cli.rank is not None:
        return run_rank(cli)
    seed = int(cli.config["seed_everything"])

    def runtime_factory() -> ClientRuntime:
        """The serialized transport's client runtime, instantiated from the same arguments: its own copies."""
        saved = rng_state()  # instantiating seeds and draws initial weights: leave the run's generators as they are
        try:
            own = build_cli([*argv, "--trainer.logger=false"])
        finally:
            set_rng_state(saved)
        return ClientRuntime(own.model, own.datamodule, own.trainer, own.config_init["federation"], seed)

    return _federation(cli, local_federation, runtime_factory=runtime_factory).run()


#: Errors that, raised before the first round trains, are the user's to fix (a key, a file, a row, a setting): the
#: command prints their message as one line and exits with status 2.
USER_ERRORS = (ValueError, KeyError, OSError, ImportError, PreconditionError)  # ImportError: an extra missing
#: Set (to anything but 0) to get the whole traceback of such an error instead.
DEBUG_ENV = "FL_LIGHTNING_DEBUG"


def command(argv: list[str] | None = None) -> int:
    """``train.py``'s entry: :func:`main`, with an error of the user's before training as one line, exit status 2.

    An error raised once a round has started training, or any error with ``FL_LIGHTNING_DEBUG=1``, keeps its
    traceback. What was written so far stays: the run directory is left for a resume or a restart.
    """
    try:
        main(argv)
    except USER_ERRORS as err:
        debug = os.environ.get(DEBUG_ENV, "0") not in ("", "0")
        # a PreconditionError is raised before the step it refuses (DP-SGD's budget checks run at a first fit)
        if debug or (_while_training(err) and not isinstance(err, PreconditionError)):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"error: {message}  (the traceback: {DEBUG_ENV}=1)", file=sys.stderr)
        return 2
    return 0


def _while_training(err: BaseException) -> bool:
    """Whether ``err`` was raised inside a round (a frame of ``Federation.run_round`` is on its traceback)."""
    return any(frame.name == "run_round" for frame in traceback.extract_tb(err.__traceback__))


def _build(argv: list[str], launch: bool = False) -> FederatedCLI:
    """:func:`build_cli`, with jsonargparse's union dump reduced to the user's own error."""
    missing = missing_extra(argv)
    if missing is not None:
        raise MissingExtra(missing)
    try:
        return build_cli(argv, launch=launch)
    except ValueError as err:
        clear = instantiation_error_message(err)
        if clear is None:
            raise
        raise ValueError(clear) from None  # the dump and jsonargparse's frames say nothing more


def config_yaml(parser: LightningArgumentParser, config: Any) -> str:
    """The resolved config as the run directory's ``config.yaml``, ``None`` values included.

    jsonargparse leaves ``None`` out by default, and a left-out key does not reproduce the run: re-parsed, a
    class argument takes what the parser's defaults or an earlier class held there (MedMNIST's ``channels: null``
    would come back as the default digits' ``channels: 1``).
    """
    return parser.dump(config, skip_check=True, skip_none=False)


def _federation(cli: FederatedCLI, make: Callable[..., Federation] = Federation, **kwargs: Any) -> Federation:
    """The run's server from the instantiated config: ``make`` is the Federation or one that builds its transport."""
    return make(
        cli.config_init["federation"],
        module=cli.model,
        datamodule=cli.datamodule,
        trainer=cli.trainer,
        seed=int(cli.config["seed_everything"]),
        config_text=config_yaml(cli.parser, cli.config),
        config_dict=cli.config.clone().as_dict(),
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------- distributed
def run_rank(cli: FederatedCLI) -> dict[str, Any]:
    """One rank of a distributed run: rank 0 runs the Federation over the ranks, the others serve their clients.

    Every rank instantiates the same config (so the same data and shards); the clients are sharded by training
    samples (:func:`~fl_lightning.engines.distributed.shard_clients`). Only rank 0 writes anything. Where this
    process started the other ranks (:attr:`FederatedCLI.ranks`), it closes them when its run ends.
    """
    rank, world, _ = cli.rank
    group = cli.ranks
    if group is None:
        return _serve_rank(cli, rank, world)
    ok = False
    try:
        summary = _serve_rank(cli, rank, world)
        ok = True
        return summary
    except RuntimeError as err:
        if group.failure is None or isinstance(err, distributed.RankError):
            raise
        raise distributed.RankError(f"{group.failure}: {err}") from err  # a call on the group failed with it
    finally:
        group.close(ok)  # waits for the other ranks' exits after a good run, else stops them


def _serve_rank(cli: FederatedCLI, rank: int, world: int) -> dict[str, Any]:
    """Join the group and run this rank: the Federation on rank 0, the client server elsewhere."""
    cfg: FederationConfig = cli.config_init["federation"]
    distributed.init_process_group(rank, world, cfg.rank_timeout)
    try:
        data = cli.datamodule
        owner = distributed.shard_clients({c: data.num_train_samples(c) for c in data.client_ids}, world)
        hosted = [c for c, r in owner.items() if r == rank]
        seed = int(cli.config["seed_everything"])
        if rank != 0:
            distributed.serve(ClientRuntime(cli.model, data, cli.trainer, cfg, seed, client_ids=hosted))
            return {}
        runtime = ClientRuntime(cli.model, data, cli.trainer, cfg, seed, prepared=True, client_ids=hosted)
        transport = distributed.DistributedTransport(runtime, owner, world)
        federation = _federation(cli, transport=transport)
        runtime.note = federation.reporter.note
        summary = federation.run()
        transport.close()
        return summary
    finally:
        distributed.destroy_process_group()


def rank_devices(config: Any, local_rank: int, cuda: bool) -> list[int] | None:
    """The Trainer's ``devices`` for local rank ``local_rank`` from a parsed config, or None to leave them as set.

    With CUDA and an accelerator other than ``cpu``, ranks share GPUs ``federation.workers_per_device`` at a time
    (:func:`~fl_lightning.engines.distributed.device_index`).
    """
    if not cuda or config.trainer.accelerator == "cpu":
        return None
    return [distributed.device_index(local_rank, config.federation.workers_per_device)]
