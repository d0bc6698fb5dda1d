"""The sweep's own files: ``sweep_results.csv`` (one row per trial), ``objective.png`` and ``importance.png``.

All three are rewritten each time a trial ends, so they show the sweep so far while it runs (and the sweep's own
process, idle while its workers train, has drawn them once before the end).

``importance.png`` shows Optuna's parameter importances (fANOVA, seeded) over the complete trials; with fewer than
two complete trials there is nothing to attribute, and the file is not written (the sweep says so).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from fl_lightning.outputs.plots import save_figure
from fl_lightning.outputs.run_dir import atomic_write_text
from fl_lightning.tools.sweep.owners import PREFIX

RESULTS = "sweep_results.csv"
OBJECTIVE_PNG = "objective.png"
IMPORTANCE_PNG = "importance.png"
BASE_COLUMNS = ["number", "state", "value", "chosen_round", "run_dir", "run_seconds"]


def result_rows(trials: Sequence[FrozenTrial], keys: Sequence[str]) -> list[dict[str, Any]]:
    """One row per trial, in number order: its state, objective value, chosen round, run directory and parameters.

    A pruned trial's value is its last reported validation value (what Optuna records for it).
    """
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        attrs = t.user_attrs
        row: dict[str, Any] = {
            "number": t.number,
            "state": t.state.name.lower(),
            "value": t.value if t.value is not None else "",
            "chosen_round": attrs.get(f"{PREFIX}round", ""),
            "run_dir": attrs.get(f"{PREFIX}run_dir", ""),
            "run_seconds": round(float(attrs[f"{PREFIX}run_seconds"]), 3) if f"{PREFIX}run_seconds" in attrs else "",
        }
        row.update({k: t.params.get(k, "") for k in keys})
        rows.append(row)
    return rows


def write_results(path: Path, trials: Sequence[FrozenTrial], keys: Sequence[str]) -> Path:
    """Write ``sweep_results.csv`` (atomically); its path."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[*BASE_COLUMNS, *keys], lineterminator="\n")
    writer.writeheader()
    writer.writerows(result_rows(trials, keys))
    atomic_write_text(path, buffer.getvalue())
    return path


def write_live(plan: Any, study: optuna.Study, trials: Sequence[FrozenTrial]) -> list[str]:
    """The sweep's three files for the trials so far (the sweep rewrites them each time a trial ends).

    Args:
        plan: The sweep (a :class:`~fl_lightning.tools.sweep.study.Plan`).
        study: Its study (for the importances).
        trials: The study's trials.

    Returns:
        One line per file for the terminal: ``wrote <path>``, or why ``importance.png`` was not written.
    """
    out = Path(plan.out)
    keys = [p.key for p in plan.space.params]
    written = (write_results(out / RESULTS, trials, keys),
               plot_objective(out / OBJECTIVE_PNG, trials, plan.objective, plan.direction))  # fmt: skip
    return [*(f"wrote {path}" for path in written), plot_importance(out / IMPORTANCE_PNG, study)]


def plot_objective(path: Path, trials: Sequence[FrozenTrial], objective: str, direction: str) -> Path:
    """``objective.png``: each trial's value by number (pruned ones marked) and the best so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ordered = sorted((t for t in trials if t.value is not None), key=lambda t: t.number)
    for state, style in ((TrialState.COMPLETE, {"marker": "o", "color": "C0"}),
                         (TrialState.PRUNED, {"marker": "x", "color": "0.5"})):  # fmt: skip
        points = [(t.number, t.value) for t in ordered if t.state == state]
        if points:
            ax.scatter(*zip(*points), label=state.name.lower(), **style)
    best, line = None, []
    pick = max if direction == "maximize" else min
    for t in ordered:
        if t.state == TrialState.COMPLETE:
            best = t.value if best is None else pick(best, t.value)
        if best is not None:
            line.append((t.number, best))
    if line:
        ax.step(*zip(*line), where="post", color="C1", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{objective} (validation, chosen round)")
    ax.legend(loc="best")
    save_figure(fig, path, dpi=120)  # renamed into place: a reader never sees half a PNG
    return path


def plot_importance(path: Path, study: optuna.Study) -> str:
    """``importance.png`` from the complete trials; what was done, as a line for the terminal."""
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if len(complete) < 2:
        return f"{IMPORTANCE_PNG} not written: {len(complete)} complete trial(s), importances need at least 2"
    try:
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)
        importances = optuna.importance.get_param_importances(study, evaluator=evaluator)
    except (ValueError, RuntimeError) as err:  # e.g. every complete trial has the same parameters
        return f"{IMPORTANCE_PNG} not written: {err}"
    if not importances or any(math.isnan(v) for v in importances.values()):
        return f"{IMPORTANCE_PNG} not written: the complete trials do not vary their parameters"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(importances)[::-1]
    fig, ax = plt.subplots(figsize=(6.4, 0.6 + 0.5 * len(names)))
    ax.barh(names, [importances[n] for n in names], color="C0")
    ax.set_xlabel(f"importance (fANOVA over {len(complete)} complete trials)")
    save_figure(fig, path, dpi=120)  # renamed into place: a reader never sees half a PNG
    return f"wrote {path}"
