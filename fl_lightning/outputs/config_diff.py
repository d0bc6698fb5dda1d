"""Which settings a resumed run may change: a pure comparison of the saved config with the new one.

A resume continues the saved weights, optimiser states and RNG streams; a setting that changes what is trained
(data, partition, seed, model, method, local budget...) would silently mix two experiments under one run
directory whose ``config.yaml`` still shows the first. Only the keys of :data:`ALLOWED_TO_CHANGE` may differ:
they extend the run or change what is shown and where it is written, never the result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import yaml

from fl_lightning.config import DATA_SHAPE_LINKS
from fl_lightning.startup.moved import canonical_class_path

# Dotted keys that may differ on resume (with everything below them: ``trainer.logger.init_args.offline``,
# ``trainer.logger[WandbLogger].project``), each with why it cannot change the result.
ALLOWED_TO_CHANGE: dict[str, str] = {
    "federation.rounds": "extends or shortens the run; round r trains the same whatever the total (see below)",
    "federation.progress": "terminal output only",
    "federation.quiet": "terminal output only",
    "federation.plots": "figures written at start and end only",
    "federation.eval_every": "evaluation never trains, and its loaders draw from no shared generator",
    "federation.eval_clients": "which clients are evaluated on intermediate rounds: evaluation never trains (tested)",
    "federation.checkpoint_every": "when checkpoints are written, not what they hold",
    "federation.keep_checkpoints": "how many old checkpoints are kept",
    "federation.resume": "where to resume from",
    "federation.output_dir": "where runs are written",
    "federation.run_name": "which run is resumed",
    "federation.transport": "in-process and serialised transport give identical results (tested)",
    "federation.workers": "clients are aggregated in the same order on any number of ranks (tested bit-identical)",
    "federation.workers_per_device": "which GPU a rank uses, not what it computes",
    "federation.rank_timeout": "how long rank 0 waits for a rank",
    "federation.reply_timeout": "how long the server waits for a Flower site",
    "federation.min_clients": "how many replies a round needs before the run stops (not what a round computes)",
    "trainer.logger": "where metrics are logged (its arguments too)",
    "trainer.enable_progress_bar": "terminal output only",
    "trainer.enable_model_summary": "terminal output only",
    "trainer.log_every_n_steps": "logging frequency only",
    "trainer.default_root_dir": "where Lightning writes its own files",
}

# Keys that are not settings of the run: ``config`` lists the config files that were read (their content is
# compared key by key), and the model's data-shape arguments are linked from ``data`` (compared there) and are
# left out of the saved YAML.
DERIVED_KEYS: frozenset[str] = frozenset({"config"} | {f"model.init_args.{k}" for k in DATA_SHAPE_LINKS})

# LRSchedule kinds whose factor of round r depends on the total number of rounds R.
_ROUNDS_DEPENDENT_SCHEDULES = ("cosine", "poly")

ABSENT = "<absent>"


@dataclass
class ConfigDiff:
    """Keys whose values differ between the saved and the new config, as ``{key: (saved, new)}``.

    Attributes:
        allowed: Differences in :data:`ALLOWED_TO_CHANGE` (recorded in the run directory).
        refused: Every other difference (the resume is refused).
    """

    allowed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    refused: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def flatten(config: Mapping[str, Any], prefix: str = "", canonical: bool = True) -> dict[str, Any]:
    """Nested mappings as ``{"a.b.c": value}``, with lists of classes keyed by class name.

    A list of ``{class_path, init_args}`` entries (``trainer.callbacks``, a list of loggers) becomes the list of
    its class paths (their order matters: hooks run in it) plus one key per argument,
    ``trainer.callbacks[FedProx].mu``; a second entry of the same class is ``[FedProx#2]``. Every other list is
    one value. With ``canonical``, class paths name where the class is defined
    (:func:`~fl_lightning.startup.moved.canonical_class_path`, so a path from before a move compares equal).
    Values are normalised as YAML would store them (tuples as lists, paths as strings), so a config parsed from
    ``config.yaml`` and one from the parser compare equal when they say the same.
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{dotted}.", canonical))
        elif _is_class_list(value):
            paths = [str(entry["class_path"]) for entry in value]
            flat[dotted] = [canonical_class_path(p) for p in paths] if canonical else paths
            for (name, _), entry in zip(entry_names(paths), value):
                flat.update(flatten(entry.get("init_args") or {}, f"{dotted}[{name}].", canonical))
        elif key == "class_path" and isinstance(value, str) and canonical:
            flat[dotted] = canonical_class_path(value)
        else:
            flat[dotted] = _normalise(value)
    return flat


def _is_class_list(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(v, Mapping) and "class_path" in v for v in value)
    )


def entry_names(class_paths: list[str]) -> list[tuple[str, str]]:
    """``(name, class path)`` per entry: the class's own name, numbered from its second entry on (``FedProx#2``)."""
    seen: Counter[str] = Counter()
    named = []
    for path in class_paths:
        name = str(path).rsplit(".", 1)[-1]
        seen[name] += 1
        named.append((name if seen[name] == 1 else f"{name}#{seen[name]}", str(path)))
    return named


def _normalise(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, (PurePath, Path)) or type(value).__name__.startswith("Path_"):  # jsonargparse's Path_fsr
        return str(value)
    return value


def is_allowed(key: str, saved: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether ``key`` may differ on resume, given both flattened configs.

    ``federation.rounds`` is allowed unless an ``LRSchedule`` of kind ``cosine`` or ``poly`` makes every round's
    learning rate depend on the total number of rounds.
    """
    if key == "federation.rounds":
        return not (_schedule_uses_rounds(saved) or _schedule_uses_rounds(new))
    return any(key == p or key.startswith((f"{p}.", f"{p}[")) for p in ALLOWED_TO_CHANGE)


def _schedule_uses_rounds(flat: Mapping[str, Any]) -> bool:
    paths = flat.get("trainer.callbacks")
    names = (
        [name for name, path in entry_names(paths) if path.endswith("LRSchedule")] if isinstance(paths, list) else []
    )
    return any(
        flat.get(f"trainer.callbacks[{name}].kind", "exponential") in _ROUNDS_DEPENDENT_SCHEDULES for name in names
    )


def diff_configs(saved: Mapping[str, Any], new: Mapping[str, Any]) -> ConfigDiff:
    """Compare the run's saved config with the resolved config of the resuming command.

    A key missing on one side counts as ``None`` there (the saved YAML leaves out ``None`` values, also among a
    callback's arguments); a key that only one side has with a value is a difference shown as ``"<absent>"``.
    Differences are named down to the argument (``trainer.callbacks[FedProx].mu``), see :func:`flatten`.

    Args:
        saved: The saved config (``yaml.safe_load`` of the run's ``config.yaml``).
        new: The new resolved config (the parser's config as a dict).

    Returns:
        The differing dotted keys, split into allowed and refused.
    """
    flat_saved, flat_new = flatten(saved), flatten(new)
    raw_saved, raw_new = flatten(saved, canonical=False), flatten(new, canonical=False)  # shown as the user wrote
    diff = ConfigDiff()
    for key in sorted((flat_saved.keys() | flat_new.keys()) - DERIVED_KEYS):
        if flat_saved.get(key) == flat_new.get(key):
            continue
        shown = (raw_saved.get(key) if key in raw_saved else ABSENT, raw_new.get(key) if key in raw_new else ABSENT)
        target = diff.allowed if is_allowed(key, flat_saved, flat_new) else diff.refused
        target[key] = shown
    return diff


def load_saved_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``config.yaml`` as a dict, or None when the run has none (e.g. a run started from Python).

    Raises:
        ValueError: If the file exists but is not a YAML mapping, naming it.
    """
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(content, dict):
        raise ValueError(f"{path} does not hold a config mapping")
    return content


def describe(differences: Mapping[str, tuple[Any, Any]]) -> str:
    """``key: saved -> new`` for each difference, one per line, for error messages."""
    return "\n".join(f"  {key}: {old!r} -> {new!r}" for key, (old, new) in differences.items())
