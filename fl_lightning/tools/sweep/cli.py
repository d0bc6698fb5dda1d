r"""``python -m fl_lightning.sweep``: tune a config's settings on the validation split with Optuna.

Example::

    python -m fl_lightning.sweep --config configs/fedprox_digits.yaml --space sweeps/fedprox.yaml \
        --trials 20 --objective val/acc_mean --seeds 3 -- --federation.rounds=10

Arguments after ``--`` go to every run (``train.py`` overrides). The same command continues a killed sweep: the
trials that were running continue from their checkpoints, and the study ends with ``--trials`` complete or pruned
trials. See ``docs/tutorials/tuning.md``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fl_lightning.tools.sweep.space import SpaceError, load_space
from fl_lightning.tools.sweep.study import (
    PRUNERS,
    SAMPLERS,
    Plan,
    check_plan,
    default_storage,
    default_study_name,
    grid_size,
    load_study,
    open_storage,
)
from fl_lightning.tools.sweep.threads import worker_threads

COMMAND = "python -m fl_lightning.sweep"
POLL = 0.25  # seconds between two looks at the study while the workers run


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", required=True, metavar="YAML",
                        help="the run's config (repeat to compose, as train.py's --config)")  # fmt: skip
    parser.add_argument("--space", required=True, type=Path, help="the search space file (e.g. sweeps/fedprox.yaml)")
    parser.add_argument("--trials", required=True, type=int, help="complete or pruned trials the study ends with")
    parser.add_argument("--objective", required=True, help="the validation metric to optimise, e.g. val/acc_mean")
    parser.add_argument("--direction", choices=("maximize", "minimize"), default=None,
                        help="default: minimize for loss, hd95 and *_std, else maximize")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3, help="seeds the best configuration is re-run with (0: none)")
    parser.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="Optuna sampler (default tpe)")
    parser.add_argument("--pruner", choices=PRUNERS, default="median", help="Optuna pruner (default median)")
    parser.add_argument("--workers", type=int, default=1, help="trials run in parallel processes on this machine")
    parser.add_argument("--storage", default=None, help="SQLAlchemy URL (default: sqlite:///<out>/study.db)")
    parser.add_argument("--study", default=None, help="study name (default: <config stem>-<space stem>)")
    parser.add_argument("--out", type=Path, default=None, help="sweep directory (default: runs/sweeps/<study>)")
    parser.add_argument("--sampler-seed", type=int, default=0, help="the sampler's seed (default 0)")
    return parser


def quiet_libraries() -> None:
    """Optuna's per-call notes ("Using an existing study ...") and Lightning's device lines stay out of the output."""
    import logging

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)


def split_extra(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The command's own arguments and the ``train.py`` overrides after ``--``."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse counts out of range, naming the option."""
    for name, low in (("trials", 1), ("workers", 1), ("seeds", 0)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name} must be >= {low}, got {getattr(args, name)}")


def sweep_place(args: argparse.Namespace) -> tuple[str, Path]:
    """The study's name and the sweep directory (absolute) the arguments give."""
    study = args.study or default_study_name(args.config, args.space)
    return study, (args.out or Path("runs") / "sweeps" / study).resolve()


def plan_from(args: argparse.Namespace, extra: list[str]) -> tuple[Plan, int]:
    """Check everything before any trial runs; the sweep's plan and the config's seed.

    Raises:
        ValueError: Naming the option or space key at fault (SpaceError for the space file).
    """
    from fl_lightning.tools.sweep.overrides import trial_overrides
    from fl_lightning.tools.sweep.validate import (
        callbacks_of,
        check_objective,
        check_space,
        objective_direction,
        parse_config,
        probe_config,
    )

    check_numbers(args)
    space = load_space(args.space)
    train_args = [a for c in args.config for a in ("--config", c)] + extra
    config = parse_config(train_args)
    check_space(space, train_args, config)
    if args.sampler == "grid" and grid_size(space.params) < args.trials:
        raise ValueError(
            f"--sampler grid: the space has {grid_size(space.params)} grid points, fewer than --trials {args.trials}"
        )
    values = {**space.fixed, **{p.key: p.probe_values()[0] for p in space.params}}
    probe = probe_config([*train_args, *trial_overrides(values, callbacks_of(config))], config)
    monitor = check_objective(args.objective, probe)
    study, out = sweep_place(args)
    logger = (config.get("trainer") or {}).get("logger")
    wandb = isinstance(logger, dict) and str(logger.get("class_path", "")).endswith("WandbLogger")
    plan = Plan(
        out=str(out),
        storage=args.storage or default_storage(out),
        study=study,
        train_args=train_args,
        space_text=space.text,
        space_path=str(args.space),
        objective=args.objective,
        direction=objective_direction(monitor, args.direction),
        sampler=args.sampler,
        pruner=args.pruner,
        seed=args.sampler_seed,
        callbacks=callbacks_of(config),
        wandb=wandb,
        trials=args.trials,
        workers=args.workers,
        seeds=args.seeds,
    )
    return plan, int(config.get("seed_everything") or 0)


def start_workers(out: Path, count: int) -> list[subprocess.Popen]:
    """Start ``count`` worker processes; each imports the training code and waits for ``go`` on its stdin."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": worker_threads(count)}
    workers = []
    for k in range(count):
        log = open(out / "logs" / f"worker-{k}.log", "ab")  # noqa: SIM115 - the worker's, closed when it is
        cmd = [sys.executable, "-m", "fl_lightning.tools.sweep.worker", str(out / "sweep.json"),
               "--parent", str(os.getpid())]  # fmt: skip
        workers.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env))
        log.close()  # the child holds its own descriptor
    return workers


def release(workers: list[subprocess.Popen], go: bool) -> None:
    """Tell each waiting worker to start (``go``) or to exit without running anything."""
    for w in workers:
        try:
            if go:
                w.stdin.write(b"go\n")
            w.stdin.close()
        except BrokenPipeError:
            pass  # that worker already ended: its log says why


def watch(plan: Plan, workers: list[subprocess.Popen], console: Console) -> None:
    """A progress bar over the trials (only on a terminal) and one line per finished trial.

    Returns when the study holds its trials or when every worker has exited (done, failed or killed).
    """
    from fl_lightning.tools.sweep.claims import DONE, counts
    from fl_lightning.tools.sweep.results import write_live

    study = load_study(plan)
    seen: set[int] = set()
    progress = Progress(
        TextColumn("trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
        disable=not console.is_terminal, transient=True,
    )  # fmt: skip
    with progress:
        task = progress.add_task("trials", total=plan.trials)
        while True:
            running = [w for w in workers if w.poll() is None]
            trials = study.get_trials(deepcopy=False)
            finished = [t for t in sorted(trials, key=lambda t: t.number)
                        if t.number not in seen and (t.state in DONE or t.state.name == "FAIL")]  # fmt: skip
            for t in finished:
                seen.add(t.number)
                value = "" if t.value is None else f" {plan.objective}={t.value:.4f}"
                progress.console.print(f"trial {t.number}: {t.state.name.lower()}{value} {t.params}")
            done = counts(trials)["done"]
            if finished and done < plan.trials:  # the results so far, while the workers train (finish writes the last)
                write_live(plan, study, trials)
            progress.update(task, completed=min(done, plan.trials))
            if not running or done >= plan.trials:  # the workers' own exits need not hold up the end
                return
            time.sleep(POLL)


def command() -> int:
    """The command line's entry: :func:`main` on ``sys.argv``, keeping the training code's imports as ``train.py``.

    The sweep imports the training code to check its input once its workers have started (they import it at the
    same time); what that import creates lives as long as the process and is kept out of the cyclic collector
    (:func:`fl_lightning.startup.heap.long_lived`), which would otherwise traverse it at every full collection
    and at exit (about 1 s with Lightning loaded).
    """
    return main(sys.argv[1:], long_lived_imports=True)


def main(argv: Sequence[str] | None = None, console: Console | None = None, long_lived_imports: bool = False) -> int:
    """Run (or continue) a sweep; 0 when it ended with its trials, 2 when its input was refused.

    Args:
        argv: The command's arguments (default ``sys.argv[1:]``).
        console: Where to print (default: the terminal).
        long_lived_imports: Import the training code as :func:`command` does (for a process of its own).
    """
    own, extra = split_extra(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    console = console or Console(soft_wrap=True)  # paths and parameters on one line each, also in a log file
    _, out = sweep_place(args)
    out.mkdir(parents=True, exist_ok=True)
    workers = start_workers(out, max(args.workers, 1))  # first: they import while this process checks the input
    if long_lived_imports:
        from fl_lightning.startup.heap import import_long_lived

        import_long_lived("fl_lightning.cli", "fl_lightning.tools.sweep.validate")
    quiet_libraries()
    try:
        plan, base_seed = plan_from(args, extra)
        study = load_study(plan, open_storage(plan.storage))
        check_plan(study, plan)
        refuse_foreign_trials(plan, study)
        plan.write()
    except (SpaceError, ValueError) as err:
        release(workers, go=False)
        for w in workers:  # still importing, nothing started: no need to wait for the imports to end
            w.terminate()
            w.wait()
        console.print(f"{COMMAND}: refused: {err}", markup=False, highlight=False)
        return 2
    release(workers, go=True)
    try:
        watch(plan, workers, console)
        status = finish(plan, base_seed, console)  # while the workers that took the last trials exit
    finally:
        for w in workers:  # an interrupt ends them too (the terminal's signal reaches the whole group)
            w.wait()
    return status


def refuse_foreign_trials(plan: Plan, study) -> None:  # noqa: ANN001 - an optuna.Study
    """Refuse a new study in a sweep directory that holds another study's trial run directories.

    Raises:
        ValueError: Naming ``--out``.
    """
    if study.trials or not plan.trials_dir.is_dir():
        return
    if any(plan.trials_dir.iterdir()):
        raise ValueError(
            f"--out {plan.out}: it holds trial run directories of another study; use another --out (or the "
            "other study's --study name to continue it)"
        )


def finish(plan: Plan, base_seed: int, console: Console) -> int:
    """The sweep's files, then the best configuration's re-runs and their test comparison."""
    from optuna.trial import TrialState

    from fl_lightning.tools.sweep.best import compare_best, rerun_best
    from fl_lightning.tools.sweep.claims import counts
    from fl_lightning.tools.sweep.results import write_live

    study = load_study(plan)
    trials = study.get_trials(deepcopy=False)
    out = Path(plan.out)
    for line in write_live(plan, study, trials):
        console.print(line)
    n = counts(trials)
    if n["done"] < plan.trials:
        console.print(
            f"{COMMAND}: the study holds {n['done']} complete or pruned trials of {plan.trials} ({n['failed']} "
            f"failed); the workers' logs in {out / 'logs'} say why. Run the same command again to go on."
        )
        return 1
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if not complete:
        console.print(f"{COMMAND}: every trial was pruned or failed: no best configuration to re-run")
        return 1
    best = study.best_trial
    chose = (
        f"best trial {best.number}: {plan.objective} = {best.value:.4f} on validation "
        f"(round {best.user_attrs.get('fl_lightning:round')}), {best.params}"
    )
    console.print(chose)
    if plan.seeds == 0:
        return 0
    rerun_best(plan, best, base_seed, console)
    status = compare_best(plan, console)
    console.print(f"chosen on validation: {chose}; the table above is its test score over {plan.seeds} seeds")
    return status


if __name__ == "__main__":
    raise SystemExit(command())
