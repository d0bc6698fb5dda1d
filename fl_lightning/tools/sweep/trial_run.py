"""One trial as a normal run: its ``train.py`` arguments, its run directory, and what it tells the study.

A trial is the project's own run (:func:`fl_lightning.cli.main` with an argument list) of the sweep's config with
the trial's values, writing ``<out>/trials/trial-NNNN`` like any run: ``config.yaml``, checkpoints, records, the
W&B run (grouped under the study's name). It chooses its round on the validation split
(``--federation.select=best --federation.monitor=<objective>``), and :class:`~.pruning.SweepPruning` reports its
rounds to the study. The objective told to the study is ``summary.json``'s ``selection.value``: the monitored
validation value at the chosen round; no test metric is read.

A trial continued after a kill resumes from its last checkpoint (``--federation.resume=last``, same arguments, same
run name), and so ends bit for bit as it would have; one that died before its first checkpoint starts its run again
(the run directory sets what it held aside).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_lightning.outputs.checkpoint import find_last_checkpoint
from fl_lightning.tools.sweep.overrides import trial_overrides
from fl_lightning.tools.sweep.study import Plan

PRUNING_CLASS = "fl_lightning.tools.sweep.pruning.SweepPruning"


def trial_name(number: int) -> str:
    """``trial-0003``."""
    return f"trial-{number:04d}"


def trial_dir(plan: Plan, number: int) -> Path:
    """The trial's run directory, ``<out>/trials/trial-NNNN``."""
    return plan.trials_dir / trial_name(number)


def run_args(
    plan: Plan, values: Mapping[str, Any], output_dir: Path, run_name: str, pruning: Mapping[str, Any] | None
) -> list[str]:
    """``train.py`` arguments of a run of the sweep's config with ``values``, choosing its round on validation.

    Args:
        plan: The sweep.
        values: The settings by space key (sampled and fixed).
        output_dir: ``federation.output_dir`` of the run.
        run_name: ``federation.run_name`` of the run.
        pruning: :class:`~.pruning.SweepPruning`'s arguments (a trial), or None (the best configuration's re-runs).
    """
    args = [
        *plan.train_args,
        *trial_overrides(values, plan.callbacks),
        f"--federation.output_dir={output_dir}",
        f"--federation.run_name={run_name}",
        "--federation.select=best",
        f"--federation.monitor={plan.objective}",
        "--federation.progress=false",
    ]
    if plan.wandb:
        args += [f"--trainer.logger.init_args.group={plan.study}", f"--trainer.logger.init_args.name={run_name}"]
    if pruning is not None:
        args.append(f"--trainer.callbacks+={json.dumps({'class_path': PRUNING_CLASS, 'init_args': dict(pruning)})}")
    return args


def trial_args(plan: Plan, number: int, values: Mapping[str, Any]) -> list[str]:
    """The arguments of trial ``number`` (the same at its start and every continuation)."""
    pruning = {"storage": plan.storage, "study": plan.study, "trial": number, "pruner": plan.pruner}
    return run_args(plan, values, plan.trials_dir, trial_name(number), pruning)


def continuation(run_dir: Path) -> list[str]:
    """What a run directory needs to go on: ``--federation.resume=last`` if it has a checkpoint, else nothing."""
    return ["--federation.resume=last"] if find_last_checkpoint(run_dir) is not None else []


def finished_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``summary.json`` if the run finished (it is written last), else None."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # half-written by a run killed while writing it: the run goes on from its checkpoint


@dataclass(frozen=True)
class Outcome:
    """What a finished run tells the study.

    Attributes:
        state: ``complete``, ``pruned`` or ``fail``.
        value: The monitored validation value at the chosen round (None when failed).
        round: The chosen round (1-based).
        error: Why it failed.
        seconds: The run's wall time in this process (0 when it had finished before).
    """

    state: str
    value: float | None = None
    round: int | None = None
    error: str = ""
    seconds: float = 0.0


def outcome(summary: Mapping[str, Any], seconds: float = 0.0) -> Outcome:
    """The study's view of a finished run: its selection's validation value, pruned or not (never a test metric)."""
    selection = summary.get("selection") or {}
    value, chosen = selection.get("value"), selection.get("round")
    pruned = bool((summary.get("sweep") or {}).get("pruned"))
    if value is None:
        return Outcome("fail", error="summary.json has no selection.value (no validation round was evaluated)",
                       seconds=seconds)  # fmt: skip
    return Outcome("pruned" if pruned else "complete", float(value), chosen, seconds=seconds)


def run_to_end(args: list[str], run_dir: Path) -> Outcome:
    """Run (or continue, or read the result of) the run ``args`` describe, writing ``run_dir``.

    A run that had finished is read, not run again; one with a checkpoint continues from it; else it starts.
    An error of the run is its failure (``fail``); an interrupt goes through (the trial stays running, and the next
    sweep continues it).
    """
    from fl_lightning.cli import main

    done = finished_summary(run_dir)
    if done is not None:
        return outcome(done)
    start = time.perf_counter()
    try:
        summary = main([*args, *continuation(run_dir)])
    except Exception as err:  # the run's own failure (diverged, every client failed...): the trial fails
        return Outcome("fail", error=f"{type(err).__name__}: {err}", seconds=time.perf_counter() - start)
    return outcome(summary, time.perf_counter() - start)
