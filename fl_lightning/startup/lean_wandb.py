"""Open a W&B run without importing W&B Launch's job machinery when no launch inputs can have been staged.

Every ``wandb.init`` ends by applying "staged launch inputs" (``Run._detect_and_apply_job_inputs``), for which it
imports ``wandb.sdk.launch.inputs.internal`` and with it W&B's whole public API client (artifacts, registries,
runs): CPU time in the process that opens the run, spent while round 1 trains (figures in
``benchmarks/MEASUREMENTS.md``). Inputs are staged only
by calling W&B Launch's input functions in this process (``wandb.sdk.launch.manage_config_file``,
``manage_wandb_config``), which imports that module; while it is not imported nothing can be staged, and the step
is skipped. Once it is imported (a script that stages inputs, or a W&B Launch job), W&B's own step runs unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

STAGING_MODULE = "wandb.sdk.launch.inputs.internal"


def install() -> None:
    """Wrap W&B's launch-input step of ``wandb.init`` (idempotent; a no-op on W&B versions without that step)."""
    from wandb.sdk import wandb_run

    original = getattr(wandb_run.Run, "_detect_and_apply_job_inputs", None)
    if original is None or getattr(original, "_fl_lightning_wrapped", False):
        return

    def detect_and_apply_job_inputs(self: Any) -> None:
        if STAGING_MODULE in sys.modules:  # something in this process may have staged inputs
            original(self)

    detect_and_apply_job_inputs._fl_lightning_wrapped = True  # type: ignore[attr-defined]
    wandb_run.Run._detect_and_apply_job_inputs = detect_and_apply_job_inputs  # type: ignore[method-assign]
