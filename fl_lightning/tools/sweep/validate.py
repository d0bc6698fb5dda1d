"""Refuse a sweep before any trial runs: every space key, range and the objective are checked against the config.

- **Keys**: each key of the space must be a key of the config as the CLI's own parser resolves it (the config
  files and the extra overrides, every default filled in), a callback's argument included.
- **Ranges**: the parser itself judges the values a key may take: the ends of each range, an interior point that is
  not an integer (a float range on an integer setting fails there) and every choice are parsed as overrides, and
  the parser's refusal is reported against the key.
- **Objective**: a validation metric the runs will log (:func:`fl_lightning.server.model_selection.parse_monitor`'s
  form), of a model the run has, and whose metric the model's evaluation produces, on data that has a validation
  split. The metric names come from the configured module itself: it evaluates one validation batch with its
  initial weights (nothing is trained, no test data is read).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fl_lightning import cli
from fl_lightning.server.model_selection import STATS, Monitor, parse_monitor
from fl_lightning.tools.sweep.overrides import CALLBACKS, KeyNotFound, lookup, trial_overrides
from fl_lightning.tools.sweep.space import Param, Space, SpaceError


class _ParseOnly(cli.FederatedCLI):
    """The project's CLI stopped after parsing: nothing is instantiated and no rank is started."""

    def before_instantiate_classes(self) -> None:
        """Nothing to prepare: nothing is built."""

    def instantiate_classes(self) -> None:
        """Parse only."""


#: The CLI's parser, built by the first :func:`parse_config` of this process: building it (Lightning's and every
#: class's signatures) costs ~0.7 s, a parse with it ~0.05 s, and a sweep's checks parse once per probe value.
_PARSER: dict[str, Any] = {}


def parse_config(args: Sequence[str]) -> dict[str, Any]:
    """The config ``args`` resolve to, as nested dicts, parsed by the CLI's parser with ``build_cli``'s settings.

    Raises:
        ValueError: With the parser's message when ``args`` do not parse.
    """
    try:
        if "cli" in _PARSER:
            return _PARSER["cli"].parse_args(list(args)).as_dict()
        parsed = _ParseOnly(
            model_class=cli.ClientModule,
            datamodule_class=cli.FederatedDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            run=False,
            args=list(args),
            trainer_defaults=cli.TRAINER_DEFAULTS,
            save_config_callback=None,
            seed_everything_default=0,
            auto_configure_optimizers=False,
            parser_kwargs={"exit_on_error": False},
        )
    except Exception as err:  # argparse.ArgumentError, or a ValueError of a config file
        raise ValueError(parse_reason(str(err))) from None
    _PARSER["cli"] = parsed.parser  # LightningCLI's public parser: the next parses reuse it
    return parsed.config.as_dict()


def parse_reason(text: str) -> str:
    """The line of a jsonargparse error that says what is wrong (its union dumps repeat every subtype's failure)."""
    for match in re.finditer(r"Expected an? (.+?)\. Got value: (.*)", text):
        expected = re.sub(r"^<class '(\w+)'>$", r"\1", match.group(1))
        if expected != "NoneType":
            return f"expects {expected}, got {match.group(2)}"
    match = re.search(r"Option '[^']+' is not accepted", text)
    if match:
        return match.group(0)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def check_space(space: Space, base_args: Sequence[str], config: Mapping[str, Any]) -> None:
    """Refuse a space key the config does not have, or a value the parser does not accept for it.

    Args:
        space: The parsed space file.
        base_args: The trial's arguments without the space's (``--config ...`` and the extra overrides).
        config: What ``base_args`` resolve to (:func:`parse_config`).

    Raises:
        SpaceError: Naming the key: not in the config, or the parser refuses a value of its range.
    """
    for key in space.keys:
        try:
            lookup(config, key)
        except KeyNotFound as err:
            raise SpaceError(f"--space {space.path}: {err}") from None
    callbacks = config.get("trainer", {}).get("callbacks")
    probes: list[tuple[str, Any, Param | None]] = [(k, v, None) for k, v in space.fixed.items()]
    probes += [(p.key, value, p) for p in space.params for value in p.probe_values()]
    # One parse per probe would cost a parse per value; all keys at once first, one by one only on a refusal.
    rounds = max([len(p.probe_values()) for p in space.params] or [1])
    for i in range(rounds):
        values = dict(space.fixed)
        values.update({p.key: p.probe_values()[min(i, len(p.probe_values()) - 1)] for p in space.params})
        try:
            parse_config([*base_args, *trial_overrides(values, callbacks)])
        except ValueError:
            break
    else:
        return
    for key, value, param in probes:
        try:
            parse_config([*base_args, *trial_overrides({**space.fixed, key: value}, callbacks)])
        except ValueError as err:
            raise SpaceError(refusal(space, key, value, param, lookup(config, key), str(err))) from None


def refusal(space: Space, key: str, value: Any, param: Param | None, current: Any, reason: str) -> str:
    """The message for a value of ``key`` that the parser refuses, with what to write instead where it is clear."""
    where = f"--space {space.path}: {key}"
    if param is not None and param.kind in ("uniform", "log_uniform") and isinstance(current, int):
        return (
            f"{where}: a {param.kind} range samples floats but {key} is an integer setting (the parser {reason}): "
            f"use {{type: int, low: {int(param.low)}, high: {int(param.high)}}}"
        )
    return f"{where}: the config's parser refuses the value {value!r}: {reason}"


# ------------------------------------------------------------------------------------------------ the objective
@dataclass(frozen=True)
class Probe:
    """What the instantiated config says about the objective.

    Attributes:
        metrics: The metric names the module's evaluation produces.
        has_validation: Whether the clients have a validation split.
        has_global_model: Whether the run has a server-side global model.
        primary_metric: The module's primary metric.
    """

    metrics: tuple[str, ...]
    has_validation: bool
    has_global_model: bool
    primary_metric: str


def probe_config(args: Sequence[str], config: Mapping[str, Any]) -> Probe:
    """Instantiate ``args`` (no logger) and evaluate one validation batch with the initial weights.

    Raises:
        ValueError: If the config does not instantiate (the CLI's message).
    """
    built = cli.build_cli([*args, "--trainer.logger=false"], log=False)
    data, module = built.datamodule, built.model
    fed = config["federation"]
    has_global = fed["mode"] == "federated" and fed["topology"] == "star"
    has_val = bool(getattr(data, "has_validation", False))
    metrics: tuple[str, ...] = ()
    if has_val:
        first = data.client_ids[0]
        batches = list(itertools.islice(iter(data.client_val_loader(first)), 1))
        metrics = tuple(sorted(module.evaluate(batches, torch.device("cpu"))))
    return Probe(metrics, has_val, has_global, module.primary_metric)


def check_objective(objective: str, probe: Probe) -> Monitor:
    """Refuse an objective the trials would never log: not a validation metric, of no model, or no such metric.

    Raises:
        ValueError: Naming ``--objective`` and what it could be instead.
    """
    try:
        monitor = parse_monitor(objective)
    except ValueError as err:
        raise ValueError(f"--objective {objective}: {str(err).split(': ', 1)[-1]}") from None
    if not probe.has_validation:
        raise ValueError(
            f"--objective {objective}: the clients have no validation split, so no val/ metric is ever logged: set "
            "one in the space file (data.init_args.val_fraction: 0.2) or after -- (--data.init_args.val_fraction=0.2)"
        )
    models = ["personal", *(["global", "pooled"] if probe.has_global_model else [])]
    if monitor.model not in models:
        raise ValueError(
            f"--objective {objective}: this run evaluates no model {monitor.model!r}; a sweep may monitor the "
            f"{', '.join(models)} model (e.g. val/{probe.primary_metric}_mean)"
        )
    if monitor.metric not in probe.metrics:
        named = ", ".join(f"val/{m}_{s}" for m in probe.metrics for s in STATS[:2])
        raise ValueError(
            f"--objective {objective}: the model's evaluation produces no metric {monitor.metric!r}; it produces "
            f"{', '.join(probe.metrics)} (e.g. {named})"
        )
    return monitor


def objective_direction(monitor: Monitor, direction: str | None) -> str:
    """``--direction`` or, when not given, the monitor's own (loss, HD95 and spreads are minimised)."""
    if direction is not None:
        return direction
    return "minimize" if monitor.lower_is_better else "maximize"


def callbacks_of(config: Mapping[str, Any]) -> Any:
    """The resolved ``trainer.callbacks`` of a parsed config."""
    return config.get("trainer", {}).get(CALLBACKS.split(".")[1])
