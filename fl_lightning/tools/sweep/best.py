"""The end of a sweep: the best trial's configuration re-run with ``--seeds`` seeds, and their test scores compared.

The best trial is chosen on its validation value alone (the study's best complete trial). Its values are run again
with ``seed_everything`` = the config's seed + 0, 1, …, ``seeds`` − 1 and the trials' torch threads (each a normal
run directory, ``<out>/best/seed-K``, choosing its round on validation like the trials; seed 0 is the trials' own
seed, so its run repeats the best trial), and ``python -m fl_lightning.tools.compare`` reports their **test** mean ±
std, beside the validation score that chose the configuration. A re-run killed with the sweep continues from its
checkpoint at the next start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from fl_lightning.tools.compare.cli import main as compare_main
from fl_lightning.tools.sweep.claims import trial_values
from fl_lightning.tools.sweep.study import Plan
from fl_lightning.tools.sweep.trial_run import Outcome, run_args, run_to_end

BEST_DIR = "best"


def seed_dirs(plan: Plan) -> list[Path]:
    """``<out>/best/seed-0`` … ``seed-(seeds-1)``."""
    return [Path(plan.out) / BEST_DIR / f"seed-{k}" for k in range(plan.seeds)]


def rerun_best(plan: Plan, best: Any, base_seed: int, console: Console) -> list[Outcome]:
    """Run the best trial's values with each seed (or continue, or read, a run already there).

    Args:
        plan: The sweep.
        best: The study's best trial (an Optuna ``FrozenTrial``).
        base_seed: The config's ``seed_everything``; seed K runs with ``base_seed + K``.
        console: Where to say what runs.
    """
    import torch

    from fl_lightning.tools.sweep.threads import worker_threads

    values = trial_values(best, plan.space.fixed)
    results = []
    # the trials' thread count: float sums depend on it, and so seed 0 (the trials' seed) reproduces the best trial
    saved = torch.get_num_threads()
    torch.set_num_threads(int(worker_threads(plan.workers)))
    try:
        for k, run_dir in enumerate(seed_dirs(plan)):
            console.print(f"best configuration, seed {base_seed + k}: {run_dir}")
            seed = f"--seed_everything={base_seed + k}"
            result = run_to_end([*run_args(plan, values, run_dir.parent, run_dir.name, None), seed], run_dir)
            if result.state == "fail":
                raise RuntimeError(f"the best configuration's run {run_dir} failed: {result.error}")
            results.append(result)
    finally:
        torch.set_num_threads(saved)
    return results


def compare_best(plan: Plan, console: Console) -> int:
    """``python -m fl_lightning.tools.compare`` over the re-runs (table printed, files in ``<out>/best/comparison``)."""
    dirs = [str(d) for d in seed_dirs(plan)]
    return compare_main([*dirs, "--out", str(Path(plan.out) / BEST_DIR / "comparison")], console=console)
