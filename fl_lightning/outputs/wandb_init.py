"""The ``wandb.init`` arguments of a run, from the config's ``WandbLogger`` arguments (a pure function).

The config names W&B's settings the way Lightning users know them, as ``WandbLogger`` arguments
(``trainer.logger.init_args``: ``project``, ``offline``, ``save_dir``, ``tags``, ``entity`` ...). The round tracker
opens the W&B run itself, with W&B's public ``wandb.init``, because two of its arguments are the run's own: the
folder (the run directory, unless the user chose a ``save_dir``) and, on a resume, the W&B run id to continue.
The mapping follows ``WandbLogger``'s documented arguments: ``save_dir``/``dir`` and ``version``/``id`` are
synonyms, ``offline`` means W&B's offline mode, ``project`` falls back to ``WANDB_PROJECT`` and then
``lightning_logs``; every other argument goes to ``wandb.init`` as it is, and one left at ``None`` is left out
(W&B's own default; an explicit ``anonymous=None`` would make W&B print that the setting is deprecated).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: WandbLogger's arguments that belong to Lightning's own use of the logger, which the round tracker does not make:
#: their default values are accepted, anything else is refused (the run would silently not do it).
LIGHTNING_ONLY = {"log_model": False, "experiment": None, "prefix": "", "checkpoint_name": None}
#: WandbLogger's arguments with no meaning for the W&B run itself.
IGNORED = {"add_file_policy"}
#: WandbLogger's default ``save_dir``: "the run directory" to us (W&B's files stay out of the working directory).
DEFAULT_SAVE_DIR = "."


def wandb_init_args(logger_args: Mapping[str, Any], run_dir: Path, run_id: str | None = None) -> dict[str, Any]:
    """``wandb.init`` keyword arguments for one run.

    Args:
        logger_args: ``trainer.logger.init_args`` (and ``dict_kwargs``) of a ``WandbLogger`` in the resolved config.
        run_dir: The run directory: W&B's folder when ``save_dir``/``dir`` is unset or ``.``.
        run_id: The W&B run id to continue (a resumed run), else the config's ``version``/``id`` (or a new one).

    Returns:
        The arguments; ``resume="allow"`` when ``run_id`` is given (a first start leaves it out: an offline part
        recorded as resumed is uploaded after the parts before it, :mod:`fl_lightning.tools.wandb_sync`),
        ``mode="offline"`` when ``offline`` is set (unless ``WANDB_MODE=disabled`` turns W&B off).

    Raises:
        ValueError: For a Lightning-only argument set to something the round tracker would not do, naming it.
    """
    args = {k: v for k, v in logger_args.items() if k not in IGNORED}
    for key, default in LIGHTNING_ONLY.items():
        value = args.pop(key, default)
        if value != default:
            raise ValueError(
                f"trainer.logger.init_args.{key}={value!r}: the round tracker logs to W&B per round and the "
                f"Federation checkpoints rounds itself (federation.checkpoint_every); leave {key} at {default!r}"
            )
    save_dir, folder = args.pop("save_dir", None), args.pop("dir", None)
    version, given_id = args.pop("version", None), args.pop("id", None)
    offline, anonymous = bool(args.pop("offline", False)), args.pop("anonymous", None)
    folder = save_dir or folder
    init = {
        "project": args.pop("project", None) or os.environ.get("WANDB_PROJECT") or "lightning_logs",
        "dir": str(run_dir) if folder in (None, DEFAULT_SAVE_DIR) else os.fspath(folder),
        "id": run_id or version or given_id,
        "resume": "allow" if run_id else None,  # a resume continues the run; a first start leaves W&B's default
    }
    if anonymous:
        init["anonymous"] = "allow"
    if offline and os.environ.get("WANDB_MODE", "").lower() != "disabled" and args.get("mode") is None:
        init["mode"] = "offline"
    init.update({k: v for k, v in args.items() if v is not None})
    return {k: v for k, v in init.items() if v is not None}


def is_offline(logger_args: Mapping[str, Any]) -> bool:
    """Whether the run will be offline (``offline``, ``mode`` or W&B's ``WANDB_MODE``), known before it opens."""
    env = os.environ.get("WANDB_MODE", "").lower()
    if env == "disabled" or logger_args.get("mode") == "disabled":
        return False
    return (
        bool(logger_args.get("offline"))
        or logger_args.get("mode") in ("offline", "dryrun")
        or env
        in (
            "offline",
            "dryrun",
        )
    )
