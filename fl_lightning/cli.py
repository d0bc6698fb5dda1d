"""``python train.py --config configs/<experiment>.yaml``: LightningCLI builds model, data, Trainer and federation."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from datamodules.base import FederatedDataModule
from fl_lightning.checkpoint import rng_state, set_rng_state
from fl_lightning.clients.base import ClientModule
from fl_lightning.config import FederationConfig
from fl_lightning.federation import Federation
from fl_lightning.runtime import ClientRuntime

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
    """LightningCLI with a ``federation:`` section and the data's shape linked into the model."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add the federation settings and link ``data.{num_classes,in_channels,image_size}`` → ``model``."""
        parser.add_class_arguments(FederationConfig, "federation")
        for attr in ("num_classes", "in_channels", "image_size"):
            parser.link_arguments(f"data.{attr}", f"model.init_args.{attr}", apply_on="instantiate")
        parser.set_defaults(
            {
                "model": {"class_path": "fl_lightning.clients.ClassificationClient"},
                "data": {"class_path": "datamodules.DigitsFederated"},
            }
        )


def build_cli(args: list[str] | None = None) -> FederatedCLI:
    """Parse ``args`` (or ``sys.argv``) and instantiate everything; errors name the offending key."""
    return FederatedCLI(
        model_class=ClientModule,
        datamodule_class=FederatedDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=args,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_callback=None,  # the Federation writes the resolved config into the run directory
        seed_everything_default=0,
        auto_configure_optimizers=False,
        parser_kwargs={"description": "Federated learning on non-IID data with one shared Lightning Trainer."},
    )


def main(args: list[str] | None = None) -> dict[str, Any]:
    """Entry point of ``train.py``; tests call it with an argument list.

    Returns:
        The final summary (also written to ``summary.json`` in the run directory).

    """
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    # W&B's own end-of-run printout repeats what our final table shows; the run directory says where its files are.
    os.environ.setdefault("WANDB_SILENT", "true")
    cli = build_cli(args)
    federation_cfg: FederationConfig = cli.config_init["federation"]
    seed = int(cli.config["seed_everything"])

    def runtime_factory() -> ClientRuntime:
        """The serialized transport's client runtime, instantiated from the same arguments: its own copies."""
        saved = rng_state()  # instantiating seeds and draws initial weights: leave the run's generators as they are
        try:
            own = build_cli([*(sys.argv[1:] if args is None else args), "--trainer.logger=false"])
        finally:
            set_rng_state(saved)
        return ClientRuntime(own.model, own.datamodule, own.trainer, own.config_init["federation"], seed)

    federation = Federation(
        federation_cfg,
        module=cli.model,
        datamodule=cli.datamodule,
        trainer=cli.trainer,
        seed=seed,
        config_text=cli.parser.dump(cli.config, skip_check=True),
        config_dict=cli.config.clone().as_dict(),
        runtime_factory=runtime_factory,
    )
    return federation.run()
