"""The sweep's study in a real database: storage, sampler and pruner, and the plan every worker follows.

Optuna's RDB storage holds the study: by default an SQLite file in the sweep directory (``sqlite:///<out>/study.db``),
or any SQLAlchemy URL given with ``--storage`` (PostgreSQL, MySQL), so several machines can share one sweep. The
:class:`Plan` is what a sweep was started with; it is written into the sweep directory (``sweep.json``, for the
workers and for people) and into the study's user attributes, so that a restart, or a second machine joining the
study, is refused when it would sample another space or score another objective under the same study name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage

from fl_lightning.tools.sweep.space import Param, Space, parse_space

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "none")
PLAN_FILE = "sweep.json"
PLAN_ATTR = "fl_lightning:plan"  # the study user attribute holding the plan's fixed part
#: Plan fields a restart (or another machine) may change: how many trials in all, how many workers and seeds, and
#: where this machine finds the directory, the database and the space file.
MAY_CHANGE = ("trials", "workers", "seeds", "out", "storage", "space_path")
#: Seconds SQLite waits for another worker's write before failing (writes are short; a trial's are a few per round).
SQLITE_TIMEOUT = 120


@dataclass
class Plan:
    """What a sweep runs: the same for every worker and every restart (but for :data:`MAY_CHANGE`).

    Attributes:
        out: The sweep directory (absolute).
        storage: The study's SQLAlchemy URL.
        study: The study's name.
        train_args: ``train.py`` arguments every trial starts from: ``--config …`` and the extra overrides.
        space_text: The space file's text (workers read the space from it, not from the file, which may change).
        space_path: Where the space file was read from (for messages).
        objective: The monitored validation metric (``val/acc_mean``).
        direction: ``maximize`` or ``minimize``.
        sampler: One of :data:`SAMPLERS`.
        pruner: One of :data:`PRUNERS`.
        seed: The sampler's seed.
        callbacks: The resolved ``trainer.callbacks`` of ``train_args`` (a trial's callback values go into them).
        wandb: Whether the trials log to W&B (their runs are then grouped under the study's name).
        trials: Complete or pruned trials the study must end with.
        workers: Worker processes on this machine.
        seeds: Seeds the best configuration is re-run with (0: none).
    """

    out: str
    storage: str
    study: str
    train_args: list[str]
    space_text: str
    space_path: str
    objective: str
    direction: str
    sampler: str
    pruner: str
    seed: int
    callbacks: Any
    wandb: bool
    trials: int
    workers: int
    seeds: int

    @property
    def space(self) -> Space:
        """The space, parsed from the recorded text."""
        import yaml

        return parse_space(yaml.safe_load(self.space_text), Path(self.space_path), self.space_text)

    @property
    def trials_dir(self) -> Path:
        """Where the trials' run directories are (``<out>/trials``)."""
        return Path(self.out) / "trials"

    def fixed_part(self) -> dict[str, Any]:
        """The fields a restart or a second machine must share."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in MAY_CHANGE}

    def write(self) -> Path:
        """Write ``sweep.json`` into the sweep directory; its path."""
        path = Path(self.out) / PLAN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> Plan:
        """A plan written by :meth:`write`."""
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))


def default_storage(out: Path) -> str:
    """``sqlite:///<out>/study.db``."""
    return f"sqlite:///{(Path(out) / 'study.db').resolve()}"


def default_study_name(config_paths: list[str], space_path: str | Path) -> str:
    """``<config stems>-<space stem>``: ``fedprox_digits-fedprox``."""
    stems = [Path(c).stem for c in config_paths] or ["default"]
    return "+".join(stems) + "-" + Path(space_path).stem


def open_storage(url: str) -> RDBStorage:
    """Optuna's RDB storage at ``url``; SQLite waits for a concurrent writer instead of failing at once.

    Raises:
        ValueError: Naming ``--storage`` when the URL cannot be opened.
    """
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": SQLITE_TIMEOUT}}
    try:
        return RDBStorage(url, **kwargs)
    except Exception as err:  # SQLAlchemy's errors for a bad URL, a missing driver, an unreachable server
        raise ValueError(f"--storage {url}: cannot open it: {err}") from None


def make_pruner(name: str) -> optuna.pruners.BasePruner:
    """Optuna's pruner for ``--pruner``: ``median`` or ``none``.

    ``median`` is Optuna's MedianPruner with its defaults: after 5 complete trials, a trial whose value at a round is
    worse than the median of the earlier trials' values at that round is pruned.
    """
    if name == "median":
        return optuna.pruners.MedianPruner()
    if name == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"--pruner {name!r}: expected one of {', '.join(PRUNERS)}")


def grid_space(params: tuple[Param, ...]) -> dict[str, list[Any]]:
    """The grid sampler's search space: every choice of each key (an int range as all its integers).

    Raises:
        ValueError: Naming a key whose range is continuous.
    """
    out: dict[str, list[Any]] = {}
    for p in params:
        if p.choices is not None:
            out[p.key] = list(p.choices)
        elif p.kind == "int":
            out[p.key] = list(range(int(p.low), int(p.high) + 1))
        else:
            raise ValueError(
                f"--sampler grid: {p.key} is a {p.kind} range, which has no grid points: make it categorical or "
                "flamby_grid ({type: flamby_grid, low_k: -6, high_k: -2}), or use --sampler tpe or random"
            )
    return out


def grid_size(params: tuple[Param, ...]) -> int:
    """How many points the grid has."""
    size = 1
    for values in grid_space(params).values():
        size *= len(values)
    return size


def make_sampler(name: str, params: tuple[Param, ...], seed: int) -> optuna.samplers.BaseSampler:
    """TPE, random or grid, seeded (a sweep's sampled configurations are reproducible with one worker)."""
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(grid_space(params), seed=seed)
    raise ValueError(f"--sampler {name!r}: expected one of {', '.join(SAMPLERS)}")


def load_study(plan: Plan, storage: RDBStorage | None = None, trial: int | None = None) -> optuna.Study:
    """The plan's study (created if new), with its pruner and, to sample a trial, its sampler.

    Args:
        plan: The sweep.
        storage: An open storage of ``plan.storage`` (default: opened here).
        trial: The number of the trial about to be sampled (its study asks for that one trial), or None for a
            study to read the trials and tell results with: its sampler does nothing after a trial (Optuna's grid
            sampler stops an ``optimize`` loop when its grid is used up, which raises outside one). The TPE and
            random samplers' seed is the plan's plus ``trial``: each worker holds its own sampler, and seeded
            alike the workers would draw the same parameters. The grid sampler keeps the plan's seed: the seed
            orders the grid points and a trial names its point by that order (its ``grid_id``), so every worker
            must order them alike.
    """
    if trial is None:
        sampler: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=plan.seed)
    else:
        seed = plan.seed if plan.sampler == "grid" else plan.seed + trial
        sampler = make_sampler(plan.sampler, plan.space.params, seed)
    return optuna.create_study(
        storage=storage or open_storage(plan.storage),
        study_name=plan.study,
        direction=plan.direction,
        sampler=sampler,
        pruner=make_pruner(plan.pruner),
        load_if_exists=True,
    )


def check_plan(study: optuna.Study, plan: Plan) -> None:
    """Record the plan in a new study; refuse one that another plan started, naming what differs.

    Raises:
        ValueError: If the study was started with another config, space, objective, sampler or pruner.
    """
    saved = study.user_attrs.get(PLAN_ATTR)
    mine = json.loads(json.dumps(plan.fixed_part()))  # as the database gives it back
    if saved is None:
        if study.trials:
            raise ValueError(
                f"--study {plan.study}: the study already holds {len(study.trials)} trials that no sweep of this "
                "command made: choose another --study name"
            )
        study.set_user_attr(PLAN_ATTR, mine)
        return
    differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    if differ:
        lines = "\n".join(f"  {k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in differ)
        raise ValueError(
            f"--study {plan.study} was started with other settings (saved -> now):\n{lines}\n"
            f"Continue it with the same command (only {', '.join(MAY_CHANGE)} may change), or start another sweep "
            "with --study NAME (and --out DIR)"
        )
