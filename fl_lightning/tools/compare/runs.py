"""Reading finished run directories, and refusing runs that cannot be compared.

The runs are grouped by method: the ``methods`` of ``summary.json`` joined with ``+`` (``FedAvg``,
``FedBN+FedProx``), with the mode where it is not ``federated`` (a ``local`` or ``centralized`` reference run is a
group of its own). A comparison holds everything fixed but the method and the seed, so the runs are refused when any
other setting of their resolved configs differs (each differing key is named, with its value in each run directory;
:data:`IGNORED` lists what may differ, an ``allow`` pattern adds a key, e.g. a setting a method needs such as
DPFedAvg's ``federation.aggregation``), and when two runs of one method have the same seed.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import yaml

from fl_lightning.outputs.config_diff import DERIVED_KEYS, flatten

SUMMARY, CONFIG, ROUNDS = "summary.json", "config.yaml", "rounds.csv"

# Flattened config keys (fnmatch patterns) that may differ between the runs of a comparison, each with why.
IGNORED: dict[str, str] = {
    "seed_everything": "the seed: what a comparison repeats",
    "data.init_args.seed": "the data's seed (each seed's own split and partition): part of what a comparison repeats",
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
    rounds = read_rounds(path / ROUNDS)
    return Run(path, with_rounds_run(config, summary, rounds), summary, rounds)


def with_rounds_run(config: dict[str, Any], summary: Mapping[str, Any], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``config`` with ``federation.rounds`` set to the rounds the run actually ran.

    A resume may run to more rounds than the ``config.yaml`` the run started with says (the saved config is the
    first start's); ``rounds.csv``'s last round (else ``summary.json``'s ``rounds``) is what was run, so runs of
    different length are never averaged as seeds of one setting, and equal ones are.
    """
    ran = rounds[-1]["round"] if rounds else summary.get("rounds")
    federation = config.get("federation")
    if not isinstance(ran, int) or not isinstance(federation, dict):
        return config
    return {**config, "federation": {**federation, "rounds": ran}}


CALLBACK_KEYS = "trainer.callbacks["  # flattened keys of the callbacks' arguments: trainer.callbacks[FedProx].mu


def method_labels(runs: Sequence[Run]) -> dict[Path, str]:
    """Each run's row: its method's name, plus the method's arguments that differ between that method's runs.

    HarmoFL with band 0.25 and with band 1.0 are two rows, ``HarmoFL (AmplitudeNormalization.band=0.25)`` and
    ``HarmoFL (AmplitudeNormalization.band=1.0)``, not seeds of one.
    """
    by_name: dict[str, list[tuple[Run, dict[str, Any]]]] = {}
    for run in runs:
        settings = {k: v for k, v in flatten(run.config).items() if k.startswith(CALLBACK_KEYS)}
        by_name.setdefault(run.method, []).append((run, settings))
    labels: dict[Path, str] = {}
    for name, members in by_name.items():
        keys = sorted({k for _, s in members for k in s})
        differ = [k for k in keys if len({repr(s.get(k)) for _, s in members}) > 1]
        for run, settings in members:
            parts = [f"{k.removeprefix(CALLBACK_KEYS).replace('].', '.')}={settings.get(k)!r}" for k in differ]
            labels[run.path] = f"{name} ({', '.join(parts)})" if parts else name
    return labels


def data_seed(run: Run) -> Any:
    """``data.init_args.seed`` of the run (None without one): with ``seed_everything``, what makes a replicate."""
    return flatten(run.config).get("data.init_args.seed")


def group_by_method(runs: Iterable[Run]) -> dict[str, list[Run]]:
    """The runs by row (:func:`method_labels`), in the order they first appear, each row's runs by seed."""
    runs = list(runs)
    labels = method_labels(runs)
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(labels[run.path], []).append(run)
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
    labels = method_labels(runs)
    for run in runs:
        if run.path.resolve() in paths:
            raise CompareRefused(f"{run.path} is given twice")
        paths.add(run.path.resolve())
        if run.seed is None:  # unseeded runs are not repeats of each other
            continue
        allowed = sorted((k, repr(v)) for k, v in flatten(run.config).items() if allowed_only(k, allow))
        key = (labels[run.path], run.seed, repr(data_seed(run)), tuple(allowed))
        if key in seen:
            seeds = f"seed {run.seed}" + ("" if data_seed(run) is None else f" and data seed {data_seed(run)}")
            raise CompareRefused(
                f"{seen[key].path} and {run.path} are both {labels[run.path]} with {seeds}: duplicates, which would "
                "count one seed twice; leave one out"
            )
        seen[key] = run
