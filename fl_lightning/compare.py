"""Compare finished runs method by method over seeds: ``python -m fl_lightning.compare RUN_DIR [RUN_DIR ...]``.

Usage::

    python -m fl_lightning.compare runs/fedavg-s0 runs/fedavg-s1 runs/fedbn-s0 runs/fedbn-s1 [--out comparison]
        [--metric acc] [--allow model.init_args.norm]

Each run directory must hold the ``config.yaml`` and ``summary.json`` of a finished run (``rounds.csv`` too for the
curves). The runs are grouped by method: the ``methods`` of ``summary.json`` joined with ``+`` (``FedAvg``,
``FedBN+FedProx``), with the mode where it is not ``federated`` (a ``local`` or ``centralized`` reference run is a
row of its own). A comparison holds everything fixed but the method and the seed, so the runs are refused (exit
status 2) when any other setting of their resolved configs differs (each differing key is named, with its value in
each run directory; :data:`IGNORED` lists what may differ, ``--allow KEY`` adds a key, e.g. a setting a method needs
such as DPFedAvg's ``federation.aggregation``), and when two runs of one method have the same seed.

For the primary metric (default: the one the run's client module reports, ``acc`` for classification, ``dice`` for
segmentation; ``--metric`` chooses another), one row per method gives mean ± sample standard deviation (ddof=1) over
seeds of the global and personal models' mean and worst client and of the pooled test set (columns no run has are
left out), and how many seeds collapsed (``summary.json``'s ``collapse.detected``). The table is printed and written
to ``--out`` (default ``comparison/``) as ``comparison.md``, with the numbers (per seed, mean and std, and the
curves) in ``comparison.json`` and the per-round curves of the client mean (mean over seeds ± std) in
``comparison.png``.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from fl_lightning.outputs.config_diff import DERIVED_KEYS, flatten
from fl_lightning.outputs.report import natural_width

COMMAND = "python -m fl_lightning.compare"
DEFAULT_OUT = Path("comparison")
SUMMARY, CONFIG, ROUNDS = "summary.json", "config.yaml", "rounds.csv"

# Flattened config keys (fnmatch patterns) that may differ between the runs of a comparison, each with why.
IGNORED: dict[str, str] = {
    "seed_everything": "the seed: what a comparison repeats",
    "trainer.callbacks*": "the method: its callbacks and every argument they take",
    "federation.mode": "local and centralized reference runs are rows of their own",
    "federation.run_name": "where the run was written",
    "federation.output_dir": "where the run was written",
    "federation.resume": "where a run continued from (a resume reproduces the uninterrupted run)",
    "federation.progress": "terminal output only",
    "federation.quiet": "terminal output only",
    "federation.plots": "figures only",
    "federation.transport": "in-process and serialised transport give identical results",
    "federation.workers*": "how many ranks ran the clients, and on which device",
    "federation.rank_timeout": "how long rank 0 waits for a rank",
    "federation.checkpoint_every": "when checkpoints were written, not what was trained",
    "federation.keep_checkpoints": "how many old checkpoints were kept",
    "trainer.logger*": "where metrics were logged",
    "trainer.enable_progress_bar": "terminal output only",
    "trainer.enable_model_summary": "terminal output only",
    "trainer.log_every_n_steps": "logging frequency only",
    "trainer.default_root_dir": "where Lightning writes its own files",
    **{key: "not a setting: the config files read, or data shapes linked from data" for key in DERIVED_KEYS},
}

# The table's value columns: name, header, and where the value sits in summary.json (model or "pooled", statistic).
COLUMNS: tuple[tuple[str, str, str, str | None], ...] = (
    ("global_mean", "global mean client", "global", "mean"),
    ("global_worst", "global worst client", "global", "worst"),
    ("personal_mean", "personal mean client", "personal", "mean"),
    ("personal_worst", "personal worst client", "personal", "worst"),
    ("pooled", "pooled", "pooled", None),
)
STD_NOTE = "mean ± std over seeds (sample std, ddof=1); with one seed, the value alone"
BAND_NOTE = "line: mean over seeds; band: ± 1 std (ddof=1)"


class CompareRefused(ValueError):
    """The runs cannot be compared: a run directory is unreadable, settings differ, or a seed is repeated."""


# ------------------------------------------------------------------------------------------------ reading runs


@dataclass(frozen=True)
class Run:
    """One finished run, as its run directory records it.

    Attributes:
        path: The run directory.
        config: Its resolved config (``config.yaml``).
        summary: Its final evaluation (``summary.json``).
        rounds: The rows of ``rounds.csv`` (empty when the file is missing).
    """

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    rounds: list[dict[str, Any]]

    @property
    def seed(self) -> int | None:
        """``seed_everything`` of the run, or None when it was not seeded."""
        return run_seed(self.config)

    @property
    def method(self) -> str:
        """The method's name (see :func:`method_name`)."""
        return method_name(self.summary)


def run_seed(config: Mapping[str, Any]) -> int | None:
    """The run's ``seed_everything`` as an int; None when absent, null or a bool (not a recorded seed)."""
    seed = config.get("seed_everything")
    if seed is None or isinstance(seed, bool):
        return None
    return int(seed)


def method_name(summary: Mapping[str, Any]) -> str:
    """The name a run is grouped under: its ``methods`` joined with ``+``, and the mode if not ``federated``.

    ``["FedBN", "FedProx"]`` is ``FedBN+FedProx``; a ``local`` run without callbacks (``methods`` is
    ``["FedAvg"]``, the default) is ``local``, one with callbacks e.g. ``FedProx (local)``.
    """
    methods = "+".join(str(m) for m in summary.get("methods") or ["FedAvg"])
    mode = summary.get("mode") or "federated"
    if mode == "federated":
        return methods
    return str(mode) if methods == "FedAvg" else f"{methods} ({mode})"


def _read_mapping(path: Path, what: str, parse: Any) -> dict[str, Any]:
    """The mapping a file holds, or CompareRefused naming the run directory and what is wrong."""
    if not path.is_file():
        raise CompareRefused(f"{path.parent}: no {path.name} ({what}); is it a finished run directory?")
    try:
        content = parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as err:
        raise CompareRefused(f"{path.parent}: {path.name} is unreadable: {err}") from err
    if not isinstance(content, dict):
        raise CompareRefused(f"{path.parent}: {path.name} does not hold a mapping")
    return content


def read_rounds(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``rounds.csv``: numbers as floats (``round`` as int), empty cells left out; [] without it."""
    if not path.is_file():
        return []
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            parsed: dict[str, Any] = {}
            for key, text in row.items():
                if key is None or text in (None, ""):
                    continue
                try:
                    parsed[key] = float(text)
                except ValueError:
                    parsed[key] = text
            if "round" in parsed:
                parsed["round"] = int(parsed["round"])
                rows.append(parsed)
    return rows


def load_run(path: Path) -> Run:
    """Read a run directory.

    Raises:
        CompareRefused: If it is not a directory, or its ``summary.json`` or ``config.yaml`` is missing or
            unreadable, naming the directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise CompareRefused(f"{path}: not a directory")
    summary = _read_mapping(path / SUMMARY, "the final evaluation; the run did not finish", json.loads)
    config = _read_mapping(path / CONFIG, "the resolved config", yaml.safe_load)
    return Run(path, config, summary, read_rounds(path / ROUNDS))


def group_by_method(runs: Iterable[Run]) -> dict[str, list[Run]]:
    """The runs by method name, methods in the order they first appear, each method's runs by seed."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.method, []).append(run)
    return {m: sorted(rs, key=lambda r: (r.seed is None, r.seed or 0, str(r.path))) for m, rs in groups.items()}


# ------------------------------------------------------------------------------------------------ comparability


def is_ignored(key: str, allow: Sequence[str] = ()) -> bool:
    """Whether a flattened config key may differ between compared runs (:data:`IGNORED` or an ``allow`` pattern)."""
    patterns = (*IGNORED, *allow)
    return any(key == p or fnmatchcase(key, p) or key.startswith((f"{p}.", f"{p}[")) for p in patterns)


def allowed_only(key: str, allow: Sequence[str]) -> bool:
    """Whether ``key`` may differ only because of an ``allow`` pattern (not :data:`IGNORED`)."""
    return bool(allow) and is_ignored(key, allow) and not is_ignored(key)


def compared_settings(config: Mapping[str, Any], allow: Sequence[str] = ()) -> dict[str, Any]:
    """The flattened config (:func:`~fl_lightning.outputs.config_diff.flatten`) without the keys that may differ."""
    return {k: v for k, v in flatten(config).items() if not is_ignored(k, allow)}


def config_differences(runs: Sequence[Run], allow: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """The settings that differ between the runs, as ``{key: {run directory: value}}``.

    A key missing from a run counts as None there (the saved YAML leaves out None values).
    """
    settings = [compared_settings(r.config, allow) for r in runs]
    keys = sorted(set().union(*settings)) if settings else []
    return {
        key: {str(r.path): s.get(key) for r, s in zip(runs, settings)}
        for key in keys
        if any(s.get(key) != settings[0].get(key) for s in settings[1:])
    }


def check_comparable(runs: Sequence[Run], allow: Sequence[str] = ()) -> None:
    """Refuse runs that differ in anything but the method, the seed and the keys that may differ.

    Raises:
        CompareRefused: Naming each differing key and its value in each run directory.
    """
    differences = config_differences(runs, allow)
    if not differences:
        return
    lines = [
        f"the runs are not comparable: {len(differences)} setting(s) differ, and a comparison holds everything "
        "fixed but the method and the seed:"
    ]
    for key, values in differences.items():
        lines.append(f"  {key}:")
        lines += [f"    {run_dir}: {value!r}" for run_dir, value in values.items()]
    lines.append("(a setting the method itself needs may differ with --allow KEY)")
    raise CompareRefused("\n".join(lines))


def check_unique_seeds(runs: Sequence[Run], allow: Sequence[str] = ()) -> None:
    """Refuse a run given twice, or two runs of one method with the same seed (and the same ``allow``-ed settings).

    Raises:
        CompareRefused: Naming both run directories.
    """
    paths: set[Path] = set()
    seen: dict[tuple[Any, ...], Run] = {}
    for run in runs:
        if run.path.resolve() in paths:
            raise CompareRefused(f"{run.path} is given twice")
        paths.add(run.path.resolve())
        if run.seed is None:  # unseeded runs are not repeats of each other
            continue
        allowed = sorted((k, repr(v)) for k, v in flatten(run.config).items() if allowed_only(k, allow))
        key = (run.method, run.seed, tuple(allowed))
        if key in seen:
            raise CompareRefused(
                f"{seen[key].path} and {run.path} are both {run.method} with seed {run.seed}: duplicates, which would "
                "count one seed twice; leave one out"
            )
        seen[key] = run


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

    Returns:
        ``(model, {round: value})``, or None when ``rounds.csv`` has neither column.
    """
    for model in ("global", "personal"):
        column = f"eval/{model}/{metric}"
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
        }
        for r in runs
    ]
    flags = [entry["collapsed"] for entry in per_run]
    return {
        "seeds": [r.seed for r in runs],
        "runs": per_run,
        "stats": {name: seed_stats([e["values"][name] for e in per_run]) for name, *_ in COLUMNS},
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


def table_rows(comparison: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The comparison as a header and one row of text per method."""
    metric, columns = comparison["metric"], comparison["columns"]
    header = ["method", "seeds", *(f"{h} {metric}" for h in columns.values()), "collapsed"]
    rows = []
    for method, entry in comparison["methods"].items():
        n = len(entry["seeds"])
        cells = [format_stat(entry["stats"][name], n) for name in columns]
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
                out.append(f"{method} seed {run['seed']} ({run['run_dir']}) collapsed: {message}")
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
        _print(console, note)


def _print(console: Console, line: str) -> None:
    # soft_wrap: one line in a log file; markup/highlight off: a path with brackets prints as it is
    console.print(line, soft_wrap=True, markup=False, highlight=False)


# ------------------------------------------------------------------------------------------------ the figure


def plot_curves(comparison: Mapping[str, Any], path: Path) -> bool:
    """``comparison.png``: per method the client mean of the metric per round, mean over seeds with a ± std band.

    Returns:
        Whether a figure was written (False when no run has per-round evaluations in ``rounds.csv``).
    """
    curves = {m: e["curve"] for m, e in comparison["methods"].items() if e["curve"]}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only; needs no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metric = comparison["metric"]
    models = {c["model"] for c in curves.values()}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, c in curves.items():
        seeds = len(comparison["methods"][method]["seeds"])
        label = f"{method} ({seeds} seed{'s' if seeds != 1 else ''})"
        if len(models) > 1:
            label += f", {c['model']} model"
        (line,) = ax.plot(c["rounds"], c["mean"], marker="o", markersize=3, label=label)
        band = [(r, m, s) for r, m, s in zip(c["rounds"], c["mean"], c["std"]) if s is not None]
        if band:
            rounds, means, stds = zip(*band)
            lower = [m - s for m, s in zip(means, stds)]
            upper = [m + s for m, s in zip(means, stds)]
            ax.fill_between(rounds, lower, upper, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    model = next(iter(models)) if len(models) == 1 else "global or personal"
    ax.set_ylabel(f"test {metric} ({model} model, mean over clients)")
    ax.set_title(f"test {metric} per round")
    ax.grid(alpha=0.3)
    ax.legend(title=BAND_NOTE, fontsize="small", title_fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------ the CLI


def write_outputs(comparison: Mapping[str, Any], out: Path) -> list[Path]:
    """Write ``comparison.md``, ``comparison.json`` and (with curves) ``comparison.png`` into ``out``.

    Returns:
        The files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "comparison.md", out / "comparison.json"]
    written[0].write_text(markdown(comparison), encoding="utf-8")
    written[1].write_text(json.dumps(comparison, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    if plot_curves(comparison, out / "comparison.png"):
        written.append(out / "comparison.png")
    return written


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    """Compare run directories: print the table, write ``comparison.md``/``.json``/``.png`` into ``--out``.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).
        console: Where to print the table (default: a Rich console on stdout).

    Returns:
        0 when the comparison was written, 2 when refused (unreadable run, differing settings, repeated seed,
        unknown metric).
    """
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="finished run directories")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./comparison)")
    parser.add_argument("--metric", default=None, help="metric to compare (default: the runs' primary metric)")
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="KEY",
        help="a flattened config key (or fnmatch pattern) that may differ between runs, e.g. model.init_args.norm",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        runs = [load_run(path) for path in args.run_dirs]
        comparison = compare(runs, args.metric, args.allow)
    except CompareRefused as err:
        print(f"{COMMAND}: refused: {err}", file=sys.stderr)
        return 2
    console = console or Console()
    print_table(console, comparison)
    for path in write_outputs(comparison, args.out):
        _print(console, f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
