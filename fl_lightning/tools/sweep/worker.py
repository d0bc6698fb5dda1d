"""A sweep worker: a process that takes a trial from the study, runs it, tells the result, and takes the next.

``python -m fl_lightning.tools.sweep.worker <out>/sweep.json`` (the sweep starts ``--workers`` of them). It imports
the training code first and then waits for the sweep's go-ahead on stdin, so workers start while the sweep checks
its input, and none runs a trial when the check refuses it. Trials are taken under a lock file in the sweep
directory (one worker at a time reads the study and claims a trial), orphans first (:mod:`.claims`). Each trial's
output goes to the worker's log (``<out>/logs/worker-K.log``).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fl_lightning.tools.sweep.claims import FAILED_ATTR, decide, trial_values
from fl_lightning.tools.sweep.owners import PREFIX, Heartbeat, this_process
from fl_lightning.tools.sweep.space import Space
from fl_lightning.tools.sweep.study import Plan, load_study, open_storage
from fl_lightning.tools.sweep.trial_run import Outcome, run_to_end, trial_args, trial_dir, trial_name

LOCK = ".claim.lock"
RUN_DIR_ATTR = f"{PREFIX}run_dir"


@contextmanager
def claim_lock(out: Path) -> Iterator[None]:
    """Hold the sweep directory's claim lock (an ``flock``: it dies with its process, a kill leaves none)."""
    with open(out / LOCK, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def distributions(space: Space) -> dict:
    """The space's searched keys as Optuna distributions (what the study samples at ``ask``)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out = {}
    for p in space.params:
        if p.choices is not None:
            out[p.key] = CategoricalDistribution(list(p.choices))
        elif p.kind == "int":
            out[p.key] = IntDistribution(int(p.low), int(p.high), log=p.log)
        else:
            out[p.key] = FloatDistribution(float(p.low), float(p.high), log=p.kind == "log_uniform")
    return out


def work(plan: Plan, parent: int | None = None) -> int:
    """Take and run trials until the study has its trials; the number of trials this worker ran or read."""
    from optuna.trial import TrialState

    storage = open_storage(plan.storage)
    study = load_study(plan, storage)
    study_id = storage.get_study_id_from_name(plan.study)
    space = plan.space
    me = this_process()
    out = Path(plan.out)
    done = 0
    while parent is None or os.getppid() == parent:  # a sweep killed alone leaves its workers no new trial
        with claim_lock(out):
            trials = study.get_trials(deepcopy=False)
            decision = decide(trials, plan.trials, max_failures=plan.trials, now=time.time(), here=me)
            if decision.action == "stop":
                print(f"worker {me.pid}: {decision.reason}", flush=True)
                return done
            if decision.action == "new":  # the next trial's number is the count of trials: its sampler's seed
                trial = load_study(plan, storage, trial=len(trials)).ask(distributions(space))
                number = trial.number
            else:
                number = decision.trial.number
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
            for key, value in me.attrs().items():
                storage.set_trial_user_attr(trial_id, key, value)
            storage.set_trial_user_attr(trial_id, RUN_DIR_ATTR, str(trial_dir(plan, number).relative_to(out)))
        if decision.action == "abandon":
            storage.set_trial_user_attr(trial_id, FAILED_ATTR, "its worker died before it sampled its parameters")
            study.tell(number, state=TrialState.FAIL)
            continue
        values = trial_values(storage.get_trial(trial_id), space.fixed)
        verb = "continues" if decision.action == "continue" else "starts"
        print(f"worker {me.pid}: {trial_name(number)} {verb}: {values}", flush=True)

        def beat(trial_id: int = trial_id) -> None:
            storage.set_trial_user_attr(trial_id, f"{PREFIX}heartbeat", time.time())

        with Heartbeat(beat):
            result = run_to_end(trial_args(plan, number, values), trial_dir(plan, number))
        record(study, storage, trial_id, number, result)
        print(f"worker {me.pid}: {trial_name(number)} {result.state} {result.value} {result.error}", flush=True)
        done += 1
    return done


def record(study, storage, trial_id: int, number: int, result: Outcome) -> None:  # noqa: ANN001 - optuna objects
    """Tell the study a trial's outcome; its chosen round, run time and error as user attributes."""
    from optuna.trial import TrialState

    if result.round is not None:
        storage.set_trial_user_attr(trial_id, f"{PREFIX}round", result.round)
    if result.seconds:
        storage.set_trial_user_attr(trial_id, f"{PREFIX}run_seconds", result.seconds)
    if result.state == "fail":
        storage.set_trial_user_attr(trial_id, FAILED_ATTR, result.error[-2000:])
        study.tell(number, state=TrialState.FAIL)
    elif result.state == "pruned":
        study.tell(number, state=TrialState.PRUNED)
    else:
        study.tell(number, result.value)


def main(argv: list[str] | None = None) -> int:
    """The worker's entry: import the training code, wait for ``go`` on stdin, then :func:`work`."""
    parser = argparse.ArgumentParser(prog="python -m fl_lightning.tools.sweep.worker")
    parser.add_argument("plan", type=Path, help="the sweep's sweep.json")
    parser.add_argument("--parent", type=int, default=None, help="the sweep's pid: stop taking trials when it is gone")
    parser.add_argument("--no-wait", action="store_true", help="start at once instead of waiting for 'go' on stdin")
    args = parser.parse_args(argv)
    from fl_lightning.startup.heap import long_lived

    with long_lived():  # the bulk of a worker's start, done before the go-ahead; kept as train.py keeps it
        import fl_lightning.cli  # noqa: F401
        from fl_lightning.tools.sweep.cli import quiet_libraries

        # Optuna imports SQLAlchemy and Alembic at the first RDB storage (~0.6 s): open one on a throwaway
        # in-memory database now, so the go-ahead finds them imported
        open_storage("sqlite:///:memory:")
    quiet_libraries()

    if not args.no_wait and sys.stdin.readline().strip() != "go":
        return 0  # the sweep refused its input (or was stopped) before any trial
    work(Plan.read(args.plan), args.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
