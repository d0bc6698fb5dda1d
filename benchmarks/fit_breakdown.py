"""Where the Federation's time goes beyond a plain PyTorch loop, per client fit and per step, on a CPU or a GPU.

Runs the workload of ``benchmarks/overhead.py`` (digits, 10 clients, FedAvg, SmallCNN, batch 32, 1 local epoch)
twice each way: timed (the device synchronised at the boundaries below, in both paths) and, on CUDA, once more
counting the host synchronisations by where they come from (``torch.cuda.set_sync_debug_mode``). The Federation's
time is split into

- Lightning's fit set-up: ``trainer.fit`` called → first training batch starts (``Trainer._run``: strategy and
  optimiser set-up, loader processing, loop resets);
- steps: first batch starts → last batch ends, over the steps run (forward, backward, optimiser step, the data
  loader, and Lightning's per-step dispatch: hooks, closure, ``LightningOptimizer``);
- Lightning's fit teardown: last batch ends → ``trainer.fit`` returns;
- the client runtime's own work around the fit (load the weights, copy the state out, checks, the reply);
- the server's own work in the rounds (tasks and replies, aggregation, round records, the round checkpoint) and
  before and after them (run directory, initial checkpoint, final report);
- evaluation (the global model on each client's test set, pooled metrics).

The plain loop is split the same way (set-up: load the weights and build the optimiser; steps; the copy into the
running mean). Prints milliseconds per fit and per step for both, and the host syncs per fit by owner.

    python benchmarks/fit_breakdown.py [--device cuda] [--rounds 20] [--image-size 16]
"""

# ruff: noqa: E402 (the imports of the repository follow the sys.path set-up)
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # runs from a checkout, installed or not

import lightning as L
import overhead
import torch
import torch.nn.functional as F

from fl_lightning import Federation
from fl_lightning import runtime as runtime_module
from fl_lightning.local_fit import LocalFitter
from fl_lightning.ops import RunningWeightedMean, aggregation_weights


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
    """Marks the first batch's start and the last batch's end of every fit."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.first, self.last, self.steps = clock, 0.0, 0.0, 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.steps == 0:
            self.first = self.clock.now()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps += 1
        self.last = self.clock.now()


@contextlib.contextmanager
def patched(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def timed_federation(args: argparse.Namespace) -> dict[str, Any]:
    """Run the Federation once with marks around every fit; the split in seconds."""
    clock = Clock(args.device)
    marks = StepMarks(clock)
    fits: list[dict[str, float]] = []

    def fit_wrapper(fit: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: LocalFitter, *a: Any, **kw: Any) -> Any:
            if marks not in self.trainer.callbacks:
                self.trainer.callbacks.append(marks)
            marks.steps = 0
            start = clock.now()
            result = fit(self, *a, **kw)
            end = clock.now()
            fits.append(
                {
                    "setup": marks.first - start,
                    "steps": marks.last - marks.first,
                    "teardown": end - marks.last,
                    "n": marks.steps,
                }
            )
            return result

        return wrapped

    in_round = [False]

    def handle_wrapper(handle: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, task: Any) -> Any:
            kind = "fit" if task.kind == "fit" else "other"
            with clock.span(f"{kind} in a round" if in_round[0] else f"{kind} outside rounds"):
                return handle(self, task)

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

    with (
        patched(LocalFitter, "fit", fit_wrapper),
        patched(runtime_module.ClientRuntime, "handle", handle_wrapper),
        patched(Federation, "run_round", round_wrapper),
    ):
        start = clock.now()
        overhead.run_federation(args)
        total = clock.now() - start
    fit_total = sum(f["setup"] + f["steps"] + f["teardown"] for f in fits)
    fit_handled = clock.total("fit in a round") + clock.total("fit outside rounds")
    other_handled = clock.total("other in a round") + clock.total("other outside rounds")
    return {
        "total": total,
        "fits": len(fits),
        "steps": sum(f["n"] for f in fits),
        "setup": sum(f["setup"] for f in fits),
        "step_time": sum(f["steps"] for f in fits),
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
    data = overhead.make_data(args)
    net = overhead.make_model(data, args).net.to(args.device)
    ids = data.client_ids
    weights = aggregation_weights([data.num_train_samples(c) for c in ids])
    start = clock.now()
    global_state = copy.deepcopy(net.state_dict())
    steps = 0
    for _ in range(args.rounds):
        mean = RunningWeightedMean()
        for cid, weight in zip(ids, weights):
            with clock.span("setup"):
                net.load_state_dict(global_state)
                net.train()
                opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
            with clock.span("steps"):
                for x, y in data.client_train_loader(cid):
                    x, y = x.to(args.device), y.to(args.device)
                    opt.zero_grad()
                    F.cross_entropy(net(x), y).backward()
                    opt.step()
                    steps += 1
            with clock.span("own"):
                mean.add(net.state_dict(), weight)
        global_state = mean.result()
    net.load_state_dict(global_state)
    with clock.span("evaluation"):
        for cid in ids:
            overhead.evaluate(net, data.client_test_loader(cid), data.num_classes, args.device)
        overhead.evaluate(net, data.pooled_test_loader(), data.num_classes, args.device)
    total = clock.now() - start
    return {
        "total": total,
        "fits": len(ids) * args.rounds,
        "steps": steps,
        "setup": clock.total("setup"),
        "step_time": clock.total("steps"),
        "own": clock.total("own"),
        "evaluation": clock.total("evaluation"),
    }


def count_syncs(args: argparse.Namespace) -> tuple[collections.Counter[str], int]:
    """Host synchronisations of one Federation run, by the innermost frame of ours or Lightning's that caused it."""
    counts: collections.Counter[str] = collections.Counter()
    fits = [0]

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

    def fit_wrapper(fit: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: LocalFitter, *a: Any, **kw: Any) -> Any:
            fits[0] += 1
            return fit(self, *a, **kw)

        return wrapped

    with warnings.catch_warnings(), patched(LocalFitter, "fit", fit_wrapper):
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            overhead.run_federation(args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return counts, fits[0]


def profile_owners(args: argparse.Namespace) -> tuple[dict[str, float], int]:
    """Self time of one Federation run under cProfile, summed by the package of each function."""
    import cProfile
    import pstats

    fits = [0]

    def fit_wrapper(fit: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: LocalFitter, *a: Any, **kw: Any) -> Any:
            fits[0] += 1
            return fit(self, *a, **kw)

        return wrapped

    profiler = cProfile.Profile()
    with patched(LocalFitter, "fit", fit_wrapper):
        profiler.runcall(overhead.run_federation, args)
    dirs = {"Lightning": Path(L.__file__).parent, "torch (Python)": Path(torch.__file__).parent, "ours": ROOT}
    owners: dict[str, float] = collections.defaultdict(float)
    for (filename, _, _), (_, _, self_time, *_) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        path = Path(filename)
        owner = next((k for k, d in dirs.items() if path.is_relative_to(d)), None)
        if owner is None:
            owner = "C calls (torch ops, copies, launches)" if filename == "~" else "Python stdlib and others"
        owners[owner] += self_time
    return owners, fits[0]


def ms(seconds: float, count: int) -> str:
    return f"{seconds / max(count, 1) * 1e3:8.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each path; the fastest is reported")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--profile", action="store_true", help="also the self time under cProfile by owner")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overhead.run_plain(args)  # warm-up: kernels, allocator, imports
    plain = min((timed_plain(args) for _ in range(args.repeats)), key=lambda r: r["total"])
    fed = min((timed_federation(args) for _ in range(args.repeats)), key=lambda r: r["total"])
    fits, steps = fed["fits"], fed["steps"]
    print(
        f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}), "
        f"torch {torch.__version__}, Lightning {L.__version__}; {fits} fits, {steps} steps, synchronised marks"
    )
    print(f"{'part':<50}{'plain ms/fit':>13}{'ours ms/fit':>13}{'ours − plain':>14}")
    rows = [
        ("set-up before the first step", plain["setup"], fed["setup"]),
        ("steps", plain["step_time"], fed["step_time"]),
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
        f"per step: plain {ms(plain['step_time'], plain['steps'])} ms, ours {ms(fed['step_time'], steps)} ms "
        f"(Lightning's per-step dispatch ≈ {ms(fed['step_time'] - plain['step_time'], steps)} ms)"
    )
    print(f"ratio of whole runs (synchronised marks): {fed['total'] / plain['total']:.3f}")
    if args.profile:
        owners, counted_fits = profile_owners(args)
        print(f"self time under cProfile by owner, ms per fit ({counted_fits} fits; the profiler inflates Python):")
        for owner, seconds in sorted(owners.items(), key=lambda kv: -kv[1]):
            print(f"  {ms(seconds, counted_fits)}  {owner}")
    if args.device == "cuda":
        try:
            counts, counted_fits = count_syncs(args)
        except Exception as err:  # noqa: BLE001 - the timings above stand without the counts
            print(f"counting the host synchronisations failed: {err!r}")
            return
        print(f"host synchronisations per fit ({counted_fits} fits), by the frame that caused them:")
        for where, n in counts.most_common():
            print(f"  {n / counted_fits:7.2f}  {where}")


if __name__ == "__main__":
    main()
