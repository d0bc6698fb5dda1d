"""The numbers of a comparison and its table: mean ± sample std over seeds per method, and how many collapsed.

For the primary metric (default: the one the run's client module reports, ``acc`` for classification, ``dice`` for
segmentation), one row per method gives mean ± sample standard deviation (ddof=1) over seeds of the global and
personal models' mean and worst client and of the pooled test set (columns no run has are left out), and how many
seeds collapsed (``summary.json``'s ``collapse.detected``); :func:`compare` computes what ``comparison.json`` holds,
:func:`markdown` and :func:`print_table` show it.
"""

from __future__ import annotations

import importlib
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from fl_lightning.outputs.report import natural_width
from fl_lightning.tools.compare.runs import (
    IGNORED,
    CompareRefused,
    Run,
    check_comparable,
    check_unique_seeds,
    group_by_method,
)

# The table's value columns: name, header, and where the value sits in summary.json (model or "pooled", statistic).
COLUMNS: tuple[tuple[str, str, str, str | None], ...] = (
    ("global_mean", "global mean client", "global", "mean"),
    ("global_worst", "global worst client", "global", "worst"),
    ("personal_mean", "personal mean client", "personal", "mean"),
    ("personal_worst", "personal worst client", "personal", "worst"),
    ("pooled", "pooled", "pooled", None),
)
STD_NOTE = "mean ± std over seeds (sample std, ddof=1); with one seed, the value alone"


# ------------------------------------------------------------------------------------------------ the numbers


def summary_metrics(summary: Mapping[str, Any]) -> list[str]:
    """The metrics a summary holds, in order: those of its models' summaries (global first), then pooled ones."""
    models = summary.get("summary") or {}
    order = [m for m in ("global", "personal") if m in models] + [m for m in models if m not in ("global", "personal")]
    names = [name for model in order for name in models[model] or {}]
    names += list(summary.get("pooled") or {})
    return list(dict.fromkeys(names))


def model_primary_metric(config: Mapping[str, Any]) -> str | None:
    """The ``primary_metric`` of the run's client module class (``model.class_path``), or None if not importable."""
    model = config.get("model")
    path = model.get("class_path") if isinstance(model, Mapping) else None
    if not isinstance(path, str) or "." not in path:
        return None
    module, _, name = path.rpartition(".")
    try:
        value = getattr(importlib.import_module(module), name).primary_metric
    except (ImportError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def default_metric(runs: Sequence[Run]) -> str:
    """The primary metric of the comparison.

    ``summary.json``'s ``primary_metric`` if it records one, else the client module's (``acc`` for
    classification, ``dice`` for segmentation), else the first metric of the first run's global summary.
    ``summary.json`` stores keys sorted, so its first metric is ``acc`` for segmentation too (pixel accuracy):
    hence the module's first.

    Raises:
        CompareRefused: If no run holds any metric.
    """
    available = [name for run in runs for name in summary_metrics(run.summary)]
    for run in runs:
        recorded = run.summary.get("primary_metric") or model_primary_metric(run.config)
        if recorded in available:
            return recorded
    if not available:
        raise CompareRefused("no run's summary.json holds a metric")
    return available[0]


def run_values(summary: Mapping[str, Any], metric: str) -> dict[str, float | None]:
    """The run's value of ``metric`` per column of :data:`COLUMNS` (None where it has none, or it was NaN)."""
    values: dict[str, float | None] = {}
    for name, _, source, stat in COLUMNS:
        if source == "pooled":
            value = (summary.get("pooled") or {}).get(metric)
        else:
            value = (((summary.get("summary") or {}).get(source) or {}).get(metric) or {}).get(stat)
        values[name] = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    return values


def seed_stats(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and sample std (ddof=1) of the values present; ``std`` is None with fewer than two, both with none.

    Returns:
        ``{"mean", "std", "n"}``, ``n`` the number of values present.
    """
    present = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(present) if present else None,
        "std": statistics.stdev(present) if len(present) > 1 else None,
        "n": len(present),
    }


def collapse_flag(summary: Mapping[str, Any]) -> bool | None:
    """``collapse.detected`` of a summary; None when it records no collapse checks (older runs)."""
    collapse = summary.get("collapse")
    if not isinstance(collapse, Mapping) or "detected" not in collapse:
        return None
    return bool(collapse["detected"])


def curve(run: Run, metric: str) -> tuple[str, dict[int, float]] | None:
    """The run's client-mean ``metric`` per evaluated round from ``rounds.csv``: ``eval/global/``, else personal.

    A run with a validation split has validation curves only (``val/global/``, ``val/personal/``: its test sets
    were read once, at the end); they are its curve.

    Returns:
        ``(model, {round: value})``, or None when ``rounds.csv`` has none of the columns.
    """
    for prefix, model in (("eval", "global"), ("eval", "personal"), ("val", "global"), ("val", "personal")):
        column = f"{prefix}/{model}/{metric}"
        points = {
            row["round"]: row[column]
            for row in run.rounds
            if isinstance(row.get(column), float) and math.isfinite(row[column])
        }
        if points:
            return model, points
    return None


def method_curve(runs: Sequence[Run], metric: str) -> dict[str, Any] | None:
    """Mean and std (ddof=1) over the method's seeds per round, of the model most of its runs have curves of.

    Returns:
        ``{"model", "rounds", "mean", "std", "n"}`` (``std`` None where one seed has the round), or None without
        curves.
    """
    curves = [c for c in (curve(r, metric) for r in runs) if c is not None]
    if not curves:
        return None
    models = [model for model, _ in curves]
    model = "global" if "global" in models else models[0]
    points = [p for m, p in curves if m == model]
    rounds = sorted(set().union(*points))
    stats = [seed_stats([p.get(r) for p in points]) for r in rounds]
    return {
        "model": model,
        "rounds": rounds,
        "mean": [s["mean"] for s in stats],
        "std": [s["std"] for s in stats],
        "n": [s["n"] for s in stats],
    }


def method_entry(runs: Sequence[Run], metric: str) -> dict[str, Any]:
    """One method's part of ``comparison.json``: its runs' values, their mean and std per column, collapses, curve."""
    per_run = [
        {
            "run_dir": str(r.path),
            "seed": r.seed,
            "collapsed": collapse_flag(r.summary),
            "collapse_messages": list((r.summary.get("collapse") or {}).get("messages") or []),
            "stopped": r.summary.get("stopped"),
            "values": run_values(r.summary, metric),
            "selection": run_selection(r.summary),
        }
        for r in runs
    ]
    flags = [entry["collapsed"] for entry in per_run]
    chosen = [e["selection"] for e in per_run if e["selection"] is not None]
    return {
        "seeds": [r.seed for r in runs],
        "runs": per_run,
        "stats": {name: seed_stats([e["values"][name] for e in per_run]) for name, *_ in COLUMNS},
        # how the reported rounds were chosen: the monitored validation value (mean ± std) and the rounds
        "selection": {
            "monitor": sorted({c["monitor"] for c in chosen}),
            "value": seed_stats([c["value"] for c in chosen]),
            "rounds": [c["round"] for c in chosen],
        }
        if chosen
        else None,
        "collapsed": {
            "count": sum(1 for f in flags if f),
            "of": len(flags),
            "unknown": sum(1 for f in flags if f is None),
            "seeds": [e["seed"] for e in per_run if e["collapsed"]],
        },
        "curve": method_curve(runs, metric),
    }


def compare(runs: Sequence[Run], metric: str | None = None, allow: Sequence[str] = ()) -> dict[str, Any]:
    """Check the runs are comparable and compute the comparison (what ``comparison.json`` holds).

    Args:
        runs: The runs, at least one.
        metric: The metric to compare (default: :func:`default_metric`).
        allow: Extra flattened config keys (fnmatch patterns) that may differ between runs.

    Returns:
        ``{"metric", "std", "columns", "methods": {method: entry}, "ignored_keys", "allowed_keys"}``,
        ``columns`` holding only the columns some run has, each entry as :func:`method_entry`.

    Raises:
        CompareRefused: If settings differ, a seed is repeated within a method, or no run has ``metric``.
    """
    if not runs:
        raise CompareRefused("no run directory given")
    check_comparable(runs, allow)
    check_unique_seeds(runs, allow)
    metric = metric or default_metric(runs)
    methods = {m: method_entry(rs, metric) for m, rs in group_by_method(runs).items()}
    columns = {
        name: header for name, header, *_ in COLUMNS if any(entry["stats"][name]["n"] for entry in methods.values())
    }
    if not columns:
        known = sorted({name for r in runs for name in summary_metrics(r.summary)})
        raise CompareRefused(f"no run's summary.json holds the metric {metric!r}; they hold: {', '.join(known)}")
    return {
        "metric": metric,
        "std": STD_NOTE,
        "columns": columns,
        "methods": methods,
        "ignored_keys": sorted(IGNORED),
        "allowed_keys": list(allow),
    }


# ------------------------------------------------------------------------------------------------ the table


def format_stat(stat: Mapping[str, Any], seeds: int) -> str:
    """``0.8123 ± 0.0132``; the mean alone with one value; ``(n=k)`` when only k of the seeds have one; ``–``."""
    if stat["mean"] is None:
        return "–"
    text = f"{stat['mean']:.4f}" if stat["std"] is None else f"{stat['mean']:.4f} ± {stat['std']:.4f}"
    return text if stat["n"] == seeds else f"{text} (n={stat['n']})"


def format_seeds(seeds: Sequence[int | None]) -> str:
    """``3 (0, 1, 2)``: the count and the seeds (``-`` for an unseeded run)."""
    return f"{len(seeds)} ({', '.join('-' if s is None else str(s) for s in seeds)})"


def format_collapsed(collapsed: Mapping[str, Any]) -> str:
    """``0 of 3``, ``1 of 3 (seed 2)``, with ``, k unknown`` for runs without collapse checks."""
    text = f"{collapsed['count']} of {collapsed['of']}"
    if collapsed["seeds"]:
        text += f" (seed {', '.join('-' if s is None else str(s) for s in collapsed['seeds'])})"
    if collapsed["unknown"]:
        text += f", {collapsed['unknown']} unknown"
    return text


def run_selection(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """How a run's reported round was chosen (``summary.json``'s ``selection``), or None without a validation split."""
    selection = summary.get("selection")
    if not isinstance(selection, Mapping):
        return None
    return {k: selection.get(k) for k in ("select", "monitor", "round", "value")}


def format_selection(selection: Mapping[str, Any] | None, seeds: int) -> str:
    """``val/acc_mean 0.8312 ± 0.0102 at rounds 7, 9, 10``, or ``–`` for runs without a validation split."""
    if selection is None:
        return "–"
    rounds = ", ".join(str(r) for r in selection["rounds"])
    plural = "s" * (len(selection["rounds"]) > 1)
    return f"{'/'.join(selection['monitor'])} {format_stat(selection['value'], seeds)} at round{plural} {rounds}"


def table_rows(comparison: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The comparison as a header and one row of text per method (with the validation column where runs chose)."""
    metric, columns = comparison["metric"], comparison["columns"]
    chosen = any(entry.get("selection") for entry in comparison["methods"].values())
    header = ["method", "seeds", *(f"{h} {metric}" for h in columns.values())]
    header += ["chosen on (validation)"] * chosen + ["collapsed"]
    rows = []
    for method, entry in comparison["methods"].items():
        n = len(entry["seeds"])
        cells = [format_stat(entry["stats"][name], n) for name in columns]
        cells += [format_selection(entry.get("selection"), n)] * chosen
        rows.append([method, format_seeds(entry["seeds"]), *cells, format_collapsed(entry["collapsed"])])
    return header, rows


def notes(comparison: Mapping[str, Any]) -> list[str]:
    """Footnotes: how std is computed, and runs that stopped early or collapsed (with the summary's message)."""
    out = [f"{STD_NOTE}; worst client as recorded in each run's summary.json."]
    for method, entry in comparison["methods"].items():
        for run in entry["runs"]:
            if run["stopped"]:
                out.append(f"{method} seed {run['seed']} ({run['run_dir']}) stopped early: {run['stopped']}")
            for message in run["collapse_messages"]:
                # a run may carry a message without a collapse (degenerate rounds it recovered from)
                said = "collapsed" if run["collapsed"] else "did not collapse, but"
                out.append(f"{method} seed {run['seed']} ({run['run_dir']}) {said}: {message}")
    return out


def markdown(comparison: Mapping[str, Any]) -> str:
    """``comparison.md``: a title, the Markdown table, the footnotes and the run directories per method."""
    header, rows = table_rows(comparison)
    lines = [f"# Comparison: final test {comparison['metric']}", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 2) + ["---"]) + "|")
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    lines += ["", *(f"- {note}" for note in notes(comparison)), "", "Run directories:", ""]
    for method, entry in comparison["methods"].items():
        dirs = ", ".join(f"`{r['run_dir']}` (seed {r['seed']})" for r in entry["runs"])
        lines.append(f"- {method}: {dirs}")
    return "\n".join(lines) + "\n"


def rich_table(comparison: Mapping[str, Any]) -> Table:
    """The table for the terminal (the same rows as :func:`markdown`)."""
    header, rows = table_rows(comparison)
    table = Table(title=f"final test {comparison['metric']}: mean ± std over seeds (ddof=1)")
    for i, name in enumerate(header):
        table.add_column(name, justify="right" if 1 < i < len(header) - 1 else "left", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def print_table(console: Console, comparison: Mapping[str, Any]) -> None:
    """Print the table and its footnotes; in a log file at the table's natural width (as the run report does)."""
    table = rich_table(comparison)
    width = console.width
    if not console.is_terminal:
        console.width = max(width, natural_width(console, table))
    try:
        console.print(table)
    finally:
        console.width = width
    for note in notes(comparison):
        print_line(console, note)


def print_line(console: Console, line: str) -> None:
    """Print one line as it is: on one line in a log file, and a path with brackets not read as markup."""
    console.print(line, soft_wrap=True, markup=False, highlight=False)
