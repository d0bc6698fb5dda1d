"""``python train.py --config configs/<experiment>.yaml``: LightningCLI builds model, data, Trainer and federation."""

from __future__ import annotations

import logging
import os
import re
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

    Returns:
        The final summary (also written to ``summary.json`` in the run directory).

    """
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    # W&B's own end-of-run printout repeats what our final table shows; the run directory says where its files are.
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        cli = build_cli(args)
    except ValueError as err:
        clear = instantiation_error_message(err)
        if clear is None:
            raise
        raise ValueError(clear) from None  # the dump and jsonargparse's frames say nothing more
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
