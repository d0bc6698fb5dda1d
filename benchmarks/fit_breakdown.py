"""Where the Federation's time goes beyond a plain PyTorch loop, per client fit and per step, on a CPU or a GPU.

Runs the workload of ``benchmarks/overhead.py`` (digits, 10 clients, FedAvg, SmallCNN, batch 32, 1 local epoch)
twice each way: timed (the device synchronised at the boundaries below, in both paths) and, on CUDA, once more
counting the host synchronisations by where they come from (``torch.cuda.set_sync_debug_mode``). The Federation's
time is split into

- Lightning's fit set-up: ``trainer.fit`` called → its ``on_train_start`` hooks (``Trainer._run``: strategy and
  optimiser set-up, loader processing, loop resets), once per round fit (``federation.round_fit``, the default) or
  once per client (``--per-client-fits``);
- steps: ``on_train_start`` → the last step's ``on_before_optimizer_step``, over the steps run (forward,
  backward, optimiser step, the data loader, and Lightning's dispatch: per step with Lightning's loop per step
  (``--lightning-loop``: hooks, closure, ``LightningOptimizer``), per client in the client loop, the default), less
  the client switches;
- client switches inside a round fit: one client's end (its ``on_train_end`` hooks, state copy, reply) and the
  next one's start (weights, ``on_client_start``, loader, a fresh optimiser, ``on_train_start``), with Lightning's
  epoch boundary around them;
- Lightning's fit teardown: the last ``on_before_optimizer_step`` → ``trainer.fit`` returns (the last update too);
- the client runtime's own work around the fit (load the weights, copy the state out, checks, the reply);
- the server's own work in the rounds (tasks and replies, aggregation, round records, the round checkpoint) and
  before and after them (run directory, initial checkpoint, final report);
- evaluation (the global model on each client's test set, pooled metrics).

The plain loop is split the same way (set-up: load the weights and build the optimiser; steps; the copy into the
running mean). Prints milliseconds per client fit (one client's local training in a round) and per step for both,
and the host syncs per client fit by owner.

    python benchmarks/fit_breakdown.py [--device cuda] [--rounds 20] [--image-size 16] [--per-client-fits]
        [--lightning-loop]
"""

# ruff: noqa: E402 (the imports of the repository follow the sys.path set-up)
from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # runs from a checkout, installed or not

import lightning as L
import overhead
import torch

from fl_lightning import Federation
from fl_lightning import runtime as runtime_module
from fl_lightning.runtime.local_fit import LocalFitter
from fl_lightning.runtime.round_fit import RoundFit


class Clock:
    """Wall-clock marks, each after synchronising the device (so queued kernels count where they were queued)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.spans: dict[str, list[float]] = collections.defaultdict(list)

    def now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.spans[name].append(self.now() - start)

    def total(self, name: str) -> float:
        return sum(self.spans.get(name, []))


class StepMarks(L.Callback):
    """Marks the first ``on_train_start`` and the last optimiser step of every Lightning fit.

    Optimiser-step hooks, not batch hooks: a callback with batch hooks would keep Lightning's loop per step.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock, self.first, self.last, self.steps = clock, 0.0, 0.0, 0

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.steps == 0:
            self.first = self.clock.now()

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps += 1
        self.last = self.clock.now()


def timed_fit(fits: list[dict[str, float]], clock: Clock, marks: StepMarks, fit: Callable[..., Any]) -> Callable:
    """``LocalFitter.fit``, ``fit_round`` or ``fit_turns`` with marks around it; each fit's split goes to ``fits``."""

    def wrapped(self: LocalFitter, *a: Any, **kw: Any) -> Any:
        if marks not in self.trainer.callbacks:
            self.trainer.callbacks.append(marks)
        marks.steps = 0
        start = clock.now()
        result = fit(self, *a, **kw)
        end = clock.now()
        fits.append({"setup": marks.first - start, "steps": marks.last - marks.first, "teardown": end - marks.last,
                     "n": marks.steps})  # fmt: skip
        return result

    return wrapped


def timed_federation(args: argparse.Namespace) -> dict[str, Any]:
    """Run the Federation once with marks around every fit; the split in seconds."""
    clock = Clock(args.device)
    marks = StepMarks(clock)
    fits: list[dict[str, float]] = []
    client_fits = [0]

    def switch_wrapper(switch: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any) -> Any:
            with clock.span("switch"):
                switch(self)
            client_fits[0] += 1

        return wrapped

    def run_wrapper(run: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any) -> Any:
            client_fits[0] += 1  # the round fit's first client
            return run(self)

        return wrapped

    in_round = [False]

    def handle_wrapper(handle_many: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, tasks: list[Any]) -> Any:  # every in-process task goes through handle_many
            replies = handle_many(self, tasks)
            for task in tasks:
                kind = "fit" if task.kind == "fit" else "other"
                with clock.span(f"{kind} in a round" if in_round[0] else f"{kind} outside rounds"):
                    reply = next(replies, None)  # a round fit spends its time on its first reply
                if reply is not None:
                    yield reply

        return wrapped

    def round_wrapper(run_round: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, *a: Any, **kw: Any) -> Any:
            in_round[0] = True
            try:
                with clock.span("rounds"):
                    return run_round(self, *a, **kw)
            finally:
                in_round[0] = False

        return wrapped

    def per_client_wrapper(fit: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: LocalFitter, *a: Any, **kw: Any) -> Any:
            client_fits[0] += 1
            return fit(self, *a, **kw)

        return wrapped

    with (
        mock.patch.object(LocalFitter, "fit", per_client_wrapper(timed_fit(fits, clock, marks, LocalFitter.fit))),
        mock.patch.object(LocalFitter, "fit_round", timed_fit(fits, clock, marks, LocalFitter.fit_round)),
        mock.patch.object(LocalFitter, "fit_turns", timed_fit(fits, clock, marks, LocalFitter.fit_turns)),
        mock.patch.object(RoundFit, "_switch", switch_wrapper(RoundFit._switch)),
        mock.patch.object(RoundFit, "run", run_wrapper(RoundFit.run)),
        mock.patch.object(
            runtime_module.ClientRuntime, "handle_many", handle_wrapper(runtime_module.ClientRuntime.handle_many)
        ),
        mock.patch.object(Federation, "run_round", round_wrapper(Federation.run_round)),
    ):
        start = clock.now()
        overhead.run_federation(args)
        total = clock.now() - start
    fit_total = sum(f["setup"] + f["steps"] + f["teardown"] for f in fits)
    fit_handled = clock.total("fit in a round") + clock.total("fit outside rounds")
    other_handled = clock.total("other in a round") + clock.total("other outside rounds")
    switches = clock.total("switch")
    return {
        "total": total,
        "fits": client_fits[0],
        "lightning_fits": len(fits),
        "steps": sum(f["n"] for f in fits),
        "setup": sum(f["setup"] for f in fits),
        "step_time": sum(f["steps"] for f in fits) - switches,
        "switches": switches,
        "teardown": sum(f["teardown"] for f in fits),
        "runtime_own": fit_handled - fit_total,
        "evaluation": other_handled,
        "server_rounds": clock.total("rounds") - clock.total("fit in a round") - clock.total("other in a round"),
        "server_fixed": total
        - clock.total("rounds")
        - clock.total("fit outside rounds")
        - clock.total("other outside rounds"),
    }


def timed_plain(args: argparse.Namespace) -> dict[str, Any]:
    """The plain loop of overhead.py with the same marks."""
    clock = Clock(args.device)
    start = clock.now()
    overhead.run_plain(args, clock.span)
    return {"total": clock.now() - start, **{part: clock.total(part) for part in clock.spans}}


def count_syncs(args: argparse.Namespace) -> collections.Counter[str]:
    """Host synchronisations of one Federation run, by the innermost frame of ours or Lightning's that caused it."""
    counts: collections.Counter[str] = collections.Counter()

    torch_dir, lightning_dir = Path(torch.__file__).parent, Path(L.__file__).parent

    def record(*_: Any, **__: Any) -> None:
        for frame in reversed(traceback.extract_stack()[:-1]):  # innermost first
            path = Path(frame.filename)
            if path.is_relative_to(lightning_dir):
                counts[f"Lightning {path.relative_to(lightning_dir)}:{frame.lineno} {frame.name}"] += 1
                return
            if path.is_relative_to(ROOT):
                counts[f"ours {path.relative_to(ROOT)}:{frame.lineno} {frame.name}"] += 1
                return
            if not (path.is_relative_to(torch_dir) or path.name == "warnings.py"):
                counts[f"other {path.name}:{frame.lineno} {frame.name}"] += 1
                return
        counts["other"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            overhead.run_federation(args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return counts


def profile_owners(args: argparse.Namespace) -> dict[str, float]:
    """Self time of one Federation run under cProfile, summed by the package of each function."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(overhead.run_federation, args)
    dirs = {"Lightning": Path(L.__file__).parent, "torch (Python)": Path(torch.__file__).parent, "ours": ROOT}
    owners: dict[str, float] = collections.defaultdict(float)
    for (filename, _, _), (_, _, self_time, *_) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        path = Path(filename)
        owner = next((k for k, d in dirs.items() if path.is_relative_to(d)), None)
        if owner is None:
            owner = "C calls (torch ops, copies, launches)" if filename == "~" else "Python stdlib and others"
        owners[owner] += self_time
    return owners


def ms(seconds: float, count: int) -> str:
    return f"{seconds / max(count, 1) * 1e3:8.3f}"


def main() -> None:
    parser = overhead.workload_parser(__doc__, 2, "timed runs of each path; the fastest is reported")
    parser.add_argument("--profile", action="store_true", help="also the self time under cProfile by owner")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overhead.run_plain(args)  # warm-up: kernels, allocator, imports
    plain = min((timed_plain(args) for _ in range(args.repeats)), key=lambda r: r["total"])
    fed = min((timed_federation(args) for _ in range(args.repeats)), key=lambda r: r["total"])
    fits, steps = fed["fits"], fed["steps"]
    print(
        f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}), "
        f"torch {torch.__version__}, Lightning {L.__version__}; {fits} client fits in {fed['lightning_fits']} "
        f"Lightning fits, {steps} steps, synchronised marks"
    )
    print(f"{'part':<50}{'plain ms/fit':>13}{'ours ms/fit':>13}{'ours − plain':>14}")
    rows = [
        ("set-up before the first step", plain["setup"], fed["setup"]),
        ("steps", plain["steps"], fed["step_time"]),
        ("client switches inside round fits", 0.0, fed["switches"]),
        ("after the last step: Lightning teardown", 0.0, fed["teardown"]),
        ("client runtime around the fit / running mean", plain["own"], fed["runtime_own"]),
        ("server in rounds: messages, aggregation, records", 0.0, fed["server_rounds"]),
        ("server before/after the rounds: set-up, report", 0.0, fed["server_fixed"]),
        ("evaluation (per fit of the run)", plain["evaluation"], fed["evaluation"]),
        ("whole run", plain["total"], fed["total"]),
    ]
    for name, p, f in rows:
        print(f"{name:<50}{ms(p, fits):>13}{ms(f, fits):>13}{ms(f - p, fits):>14}")
    print(
        f"per step: plain {ms(plain['steps'], steps)} ms, ours {ms(fed['step_time'], steps)} ms "
        f"(Lightning's per-step dispatch ≈ {ms(fed['step_time'] - plain['steps'], steps)} ms)"
    )
    print(f"ratio of whole runs (synchronised marks): {fed['total'] / plain['total']:.3f}")
    if args.profile:
        owners = profile_owners(args)
        print("self time under cProfile by owner, ms per fit (the profiler inflates Python):")
        for owner, seconds in sorted(owners.items(), key=lambda kv: -kv[1]):
            print(f"  {ms(seconds, fits)}  {owner}")
    if args.device == "cuda":
        try:
            counts = count_syncs(args)
        except Exception as err:  # noqa: BLE001 - the timings above stand without the counts
            print(f"counting the host synchronisations failed: {err!r}")
            return
        print("host synchronisations per fit, by the frame that caused them:")
        for where, n in counts.most_common():
            print(f"  {n / fits:7.2f}  {where}")


if __name__ == "__main__":
    main()
