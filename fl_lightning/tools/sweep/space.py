"""The search space file: which config keys a sweep samples, and from what.

A space file is YAML whose keys are config keys written as ``train.py`` overrides are (``model.init_args.lr``,
``data.init_args.val_fraction``; a callback's argument as ``trainer.callbacks[FedProx].mu``, see
:mod:`.overrides`). Each value is either a distribution, a mapping with a ``type``:

- ``{type: log_uniform, low, high}``: a float drawn uniformly in log space (``0 < low <= high``);
- ``{type: uniform, low, high}``: a float drawn uniformly;
- ``{type: int, low, high}``: an integer in ``[low, high]`` (``log: true`` draws in log space);
- ``{type: categorical, choices: [...]}``: one of the choices (numbers, strings, booleans or null);
- ``{type: flamby_grid, low_k, high_k}``: FLamby's grid ``10^(k/2)`` for the integers ``low_k <= k <= high_k``
  (:func:`flamby_grid`; a categorical over those values, so the grid sampler can walk it);

or a plain value, which every trial sets as it is (``data.init_args.val_fraction: 0.2``: the validation split the
objective is read on). Nothing here imports Optuna or the CLI: this module only reads and checks the file's shape;
:mod:`.validate` checks the keys and values against the config's parser.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

KINDS = ("log_uniform", "uniform", "int", "categorical", "flamby_grid")
#: The fields each kind takes (``log`` is optional for ``int``).
FIELDS: dict[str, tuple[str, ...]] = {
    "log_uniform": ("low", "high"),
    "uniform": ("low", "high"),
    "int": ("low", "high"),
    "categorical": ("choices",),
    "flamby_grid": ("low_k", "high_k"),
}
Scalar = bool | int | float | str | None


class SpaceError(ValueError):
    """The space file is malformed, or a key or range in it cannot be swept; the message names the key."""


@dataclass(frozen=True)
class Param:
    """One searched key of the space.

    Attributes:
        key: The config key, as an override names it.
        kind: One of :data:`KINDS`.
        low: Lower bound (``log_uniform``, ``uniform``, ``int``; ``low_k`` of ``flamby_grid``).
        high: Upper bound, inclusive.
        choices: The values of ``categorical`` and ``flamby_grid``.
        log: ``int`` only: draw in log space.
    """

    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    choices: tuple[Scalar, ...] | None = None
    log: bool = False

    def probe_values(self) -> list[Scalar]:
        """Values that stand for the whole range when the parser checks it: both ends, an interior point, every choice.

        For a float range the interior point is never an integer, so a float range on an integer setting is caught.
        """
        if self.choices is not None:
            return list(self.choices)
        low, high = self.low, self.high
        if self.kind == "int":
            return [int(low), int(high)]
        mid = math.sqrt(low * high) if self.kind == "log_uniform" else low + 0.37 * (high - low)
        if float(mid).is_integer():  # 1..1 or a range whose interior point happens to be whole
            mid = mid + 0.5 if mid + 0.5 <= high else mid - 0.5 if mid - 0.5 >= low else mid
        return [float(low), float(mid), float(high)]


@dataclass(frozen=True)
class Space:
    """A parsed space file.

    Attributes:
        path: Where it was read from.
        params: The searched keys, in the file's order.
        fixed: The keys every trial sets to one value, in the file's order.
        text: The file's text (recorded with the sweep, so a restart can tell it is the same space).
    """

    path: Path
    params: tuple[Param, ...]
    fixed: dict[str, Scalar]
    text: str

    @property
    def keys(self) -> list[str]:
        """Every key of the file, searched and fixed."""
        return [p.key for p in self.params] + list(self.fixed)


def flamby_grid(low_k: int, high_k: int) -> tuple[float, ...]:
    """FLamby's grid ``10^(k/2)`` for ``k = low_k … high_k``: ``flamby_grid(-4, -2)`` = 0.01, 0.0316…, 0.1.

    The grid FLamby tuned each strategy's learning rate on (its ``config_<dataset>.json`` files hold one value of
    it per strategy). Values are rounded to 12 significant digits so that ``10^(-2/2)`` is 0.1, not 0.1000…01.
    """
    if isinstance(low_k, bool) or isinstance(high_k, bool) or not (isinstance(low_k, int) and isinstance(high_k, int)):
        raise TypeError(f"flamby_grid takes integers k, got low_k={low_k!r}, high_k={high_k!r}")
    if low_k > high_k:
        raise ValueError(f"flamby_grid: low_k ({low_k}) > high_k ({high_k})")
    return tuple(float(f"{10 ** (k / 2):.12g}") for k in range(low_k, high_k + 1))


def load_space(path: str | Path) -> Space:
    """Read and check a space file (its shape only: the keys and values are the parser's to check).

    Raises:
        SpaceError: If the file is missing, is not a mapping of keys, or an entry is malformed, naming the key and
            what to write instead.
    """
    path = Path(path)
    if not path.is_file():
        raise SpaceError(f"--space {path}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpaceError(f"--space {path}: not valid YAML: {err}") from None
    return parse_space(raw, path, text)


def parse_space(raw: Any, path: Path, text: str = "") -> Space:
    """:func:`load_space` on already-loaded YAML content."""
    if not isinstance(raw, dict) or not raw:
        raise SpaceError(
            f"--space {path}: expected a mapping of config keys to distributions, e.g. "
            "'model.init_args.lr: {type: log_uniform, low: 0.001, high: 0.1}'"
        )
    params, fixed = [], {}
    for key, spec in raw.items():
        if not isinstance(key, str) or not key or " " in key or key.startswith("-"):
            raise SpaceError(f"--space {path}: {key!r} is not a config key (write it as model.init_args.lr)")
        if isinstance(spec, dict):
            params.append(parse_param(key, spec, path))
        elif spec is None or isinstance(spec, (bool, int, float, str)):
            fixed[key] = spec
        else:
            raise SpaceError(
                f"--space {path}: {key}: expected a distribution ({{type: ...}}) or one value, got {spec!r}"
            )
    if not params:
        raise SpaceError(f"--space {path}: no key is searched (each one is a fixed value): give one a distribution")
    return Space(path, tuple(params), fixed, text)


def parse_param(key: str, spec: dict[str, Any], path: Path | str = "space") -> Param:
    """One distribution entry of a space file.

    Raises:
        SpaceError: Naming ``key`` for an unknown type, a missing or unknown field, a bound of the wrong type,
            ``low > high``, a log range with ``low <= 0``, or empty or repeated choices.
    """
    where = f"--space {path}: {key}"
    kind = spec.get("type")
    if kind not in KINDS:
        raise SpaceError(f"{where}: type {kind!r} is not one of {', '.join(KINDS)}")
    allowed = {"type", *FIELDS[kind], *(("log",) if kind == "int" else ())}
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise SpaceError(f"{where}: {kind} takes {', '.join(sorted(allowed - {'type'}))}, not {', '.join(unknown)}")
    missing = [f for f in FIELDS[kind] if f not in spec]
    if missing:
        raise SpaceError(f"{where}: {kind} needs {', '.join(missing)}")
    if kind == "categorical":
        return Param(key, kind, choices=_choices(where, spec["choices"]))
    if kind == "flamby_grid":
        low_k, high_k = spec["low_k"], spec["high_k"]
        for name, value in (("low_k", low_k), ("high_k", high_k)):
            if not _is_int(value):
                raise SpaceError(f"{where}: flamby_grid's {name} is an integer k of 10^(k/2), got {value!r}")
        if low_k > high_k:
            raise SpaceError(f"{where}: low_k ({low_k}) > high_k ({high_k}): swap them")
        return Param(key, kind, low=low_k, high=high_k, choices=flamby_grid(low_k, high_k))
    low, high = spec["low"], spec["high"]
    if kind == "int":
        for name, value in (("low", low), ("high", high)):
            if not _is_int(value):
                raise SpaceError(
                    f"{where}: an int range takes integer bounds, got {name}={value!r} "
                    "(for a float setting use {type: uniform} or {type: log_uniform})"
                )
        log = spec.get("log", False)
        if not isinstance(log, bool):
            raise SpaceError(f"{where}: log is true or false, got {log!r}")
        if log and low <= 0:
            raise SpaceError(f"{where}: a log int range needs low >= 1, got {low}")
    else:
        for name, value in (("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SpaceError(f"{where}: {name} must be a finite number, got {value!r}")
        log = False
        if kind == "log_uniform" and low <= 0:
            raise SpaceError(f"{where}: a log_uniform range needs low > 0, got {low} (use uniform to include 0)")
    if low > high:
        raise SpaceError(f"{where}: low ({low}) > high ({high}): swap them")
    return Param(key, kind, low=low, high=high, log=log)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choices(where: str, choices: Any) -> tuple[Scalar, ...]:
    if not isinstance(choices, list) or not choices:
        raise SpaceError(f"{where}: choices must be a non-empty list, got {choices!r}")
    bad = [c for c in choices if not (c is None or isinstance(c, (bool, int, float, str)))]
    if bad:
        raise SpaceError(f"{where}: a choice is a number, string, boolean or null, got {bad[0]!r}")
    seen: list[Scalar] = []
    for c in choices:
        if any(type(c) is type(s) and c == s for s in seen):
            raise SpaceError(f"{where}: the choice {c!r} is listed twice")
        seen.append(c)
    return tuple(choices)
