"""Medical-size side-by-side speed benchmark: train.py against a plain PyTorch loop, as whole processes.

The workload is ``benchmarks/medical_unet.yaml`` (FedAvg of a UNet, width 16, depth 4, BatchNorm, on 4 digit
segmentation sites at 128 px, 2 local epochs, 5 rounds, evaluation every round). The variants:

* ``raw``: ``benchmarks/medical_raw.py``, the same work written directly in PyTorch (the lower bound);
* ``fl``: ``train.py`` on the same config (default logger: W&B offline), in a temporary run directory;
* any ``--extra NAME=COMMAND``: a whole command (shlex-split), or, if COMMAND starts with ``--``, train.py
  overrides added to the ``fl`` command (``--extra fl-nolog=--trainer.logger=false``).

Each variant runs once uncounted (warm-up: file caches, compiled bytecode), then ``--repeats`` times, the variants
interleaved (raw, fl, ..., raw, fl, ...) so that a drift of the machine's speed hits all alike. Before every run
the machine-wide busy CPU is read from /proc/stat over 1 s, and a warning printed if someone else is using it.
The time of a run is wall-clock from the child's launch to its exit (interpreter start-up, imports, data, all
rounds, outputs). The final Dice (mean over clients of the global model's foreground Dice) comes from the raw
loop's ``RESULT_JSON`` line, or from ``summary.json`` in a train.py variant's run directory; an extra command
that is neither reports its ``RESULT_JSON`` ``final_dice`` if it prints one.

``--rounds/--image-size/--local-epochs`` change the workload of every variant alike (train.py overrides
``--federation.rounds=``, ``--data.image_size=``, ``--federation.local_epochs=``; the raw loop's flags).
``--overrides`` adds train.py overrides (give them with ``=``: ``--overrides=--federation.rounds=1``); those three
keys also reach the raw loop, others only train.py (the output says which).

The output (date, commit, machine, the command line, a Markdown table) can be pasted into a docs page.

    python benchmarks/medical_speed.py [--repeats 5] [--rounds 5] [--image-size 128] [--local-epochs 2]
        [--extra NAME=COMMAND ...] [--overrides=OVERRIDES ...] [--json OUT]

A smoke run: ``python benchmarks/medical_speed.py --repeats 1 --rounds 1 --image-size 32 --local-epochs 1``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
CONFIG = "benchmarks/medical_unet.yaml"
#: train.py overrides the raw loop understands, and its flag for each.
RAW_FLAGS = {
    "--federation.rounds": "--rounds",
    "--data.image_size": "--image-size",
    "--federation.local_epochs": "--local-epochs",
}
BUSY_CORES = 0.25  # other load (in cores) above which the idle check warns


@dataclass
class Variant:
    """A command to time; ``train_py``: it is a train.py run (gets a run directory, reports via summary.json)."""

    name: str
    command: list[str]
    train_py: bool


@dataclass
class Run:
    """One timed run of a variant."""

    variant: str
    tag: str
    wall_s: float
    busy_cores_before: float
    final_dice: float | None = None
    pooled_dice: float | None = None
    rounds_s: float | None = None
    log: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- command line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", "-n", type=int, default=5, help="counted runs of each variant")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted runs of each variant first")
    parser.add_argument("--config", default=CONFIG, help="the train.py config both variants read")
    parser.add_argument("--rounds", type=int, default=None, help="federation.rounds of every variant")
    parser.add_argument("--image-size", type=int, default=None, help="data.image_size of every variant")
    parser.add_argument("--local-epochs", type=int, default=None, help="federation.local_epochs of every variant")
    parser.add_argument(
        "--overrides", action="append", default=[], metavar="OVERRIDES",
        help="train.py overrides for every train.py variant, shlex-split (use the = form: --overrides=--a.b=1)",
    )  # fmt: skip
    parser.add_argument(
        "--extra", action="append", default=[], metavar="NAME=COMMAND",
        help="another variant: a command, or train.py overrides on top of fl's when it starts with --",
    )  # fmt: skip
    parser.add_argument("--only", default=None, help="comma-separated variants to run (default: all)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: raw trains there, train.py gets the GPU")
    parser.add_argument(
        "--python", default=str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable,
        help="the interpreter of the children (default: the checkout's .venv, else this one)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--out", default=None, help="folder for the logs (default: a temporary folder)")
    parser.add_argument("--keep-runs", action="store_true", help="keep train.py's run directories")
    parser.add_argument("--json", default=None, metavar="OUT", help="write every timing to this JSON file")
    return parser.parse_args()


def train_overrides(args: argparse.Namespace) -> list[str]:
    """The workload overrides of every train.py variant: the shorthand flags first, then ``--overrides``."""
    values = (args.rounds, args.image_size, args.local_epochs)  # in the order of RAW_FLAGS
    out = [f"{key}={value}" for key, value in zip(RAW_FLAGS, values) if value is not None]
    if args.device != "cpu":
        out.append("--trainer.accelerator=gpu")
    for text in args.overrides:
        out += shlex.split(text)
    return out


def raw_flags(overrides: list[str]) -> tuple[list[str], list[str]]:
    """The raw loop's flags for the overrides it understands (the last one wins), and the overrides it ignores."""
    flags: dict[str, str] = {}
    ignored = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in RAW_FLAGS:
            flags[RAW_FLAGS[key]] = value
        else:
            ignored.append(item)
    return [part for flag, value in flags.items() for part in (flag, value)], ignored


def config_path(config: str) -> str:
    """The config as the children (run from the repository root) find it: relative to the root where inside it."""
    path = Path(config).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def variants(args: argparse.Namespace, overrides: list[str]) -> list[Variant]:
    """raw, fl and the extras, in the order they run; ``--only`` filters them."""
    py, config = args.python, config_path(args.config)  # the children run in ROOT
    raw_args, _ = raw_flags(overrides)
    raw_args += ["--device", args.device]
    fl = [py, "train.py", "--config", config, *overrides]
    found = [
        Variant("raw", [py, "benchmarks/medical_raw.py", "--config", config, *raw_args], False),
        Variant("fl", fl, True),
    ]
    for spec in args.extra:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command.strip():
            raise SystemExit(f"--extra wants NAME=COMMAND, got {spec!r}")
        words = shlex.split(command)
        if words[0].startswith("--"):
            found.append(Variant(name, [*fl, *words], True))
        else:
            train_py = any(Path(w).name == "train.py" for w in words)
            found.append(Variant(name, [*words, *overrides] if train_py else words, train_py))
    if args.only:
        keep = args.only.split(",")
        unknown = set(keep) - {v.name for v in found}
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(v.name for v in found)}")
        found = [v for v in found if v.name in keep]
    if len({v.name for v in found}) != len(found):
        raise SystemExit("variant names must be unique")
    return found


# ------------------------------------------------------------------------------------------------ measuring


def cpu_busy(seconds: float = 1.0) -> float:
    """Machine-wide busy CPU, in cores, over ``seconds`` (from /proc/stat)."""

    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = read()
    time.sleep(seconds)
    busy1, total1 = read()
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(1, total1 - total0)


def idle_check(label: str) -> float:
    """Busy cores before a run (nothing of ours runs then); warns above :data:`BUSY_CORES`."""
    busy = cpu_busy()
    if busy > BUSY_CORES:
        load = Path("/proc/loadavg").read_text().split()[0]
        print(f"  warning: machine not idle before {label}: {busy:.2f} cores busy (load {load})", flush=True)
    return busy


def result_json(log: Path) -> dict[str, Any]:
    """The last ``RESULT_JSON {...}`` line of a log, or {}."""
    found: dict[str, Any] = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("RESULT_JSON "):
            found = json.loads(line[len("RESULT_JSON ") :])
    return found


def read_run_dir(run_dir: Path) -> dict[str, Any]:
    """Final Dice (client mean, pooled) and the sum of ``time/round`` from a train.py run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "rounds.csv", newline="") as fh:
        rounds = list(csv.DictReader(fh))
    return {
        "final_dice": summary["summary"]["global"]["dice"]["mean"],
        "final_pooled_dice": summary.get("pooled", {}).get("dice"),
        "round_s": [float(r["time/round"]) for r in rounds],
        "rounds_s": sum(float(r["time/round"]) for r in rounds),
    }


def run_once(variant: Variant, tag: str, logs: Path, runs: Path, args: argparse.Namespace) -> Run:
    """Launch, wait, time; then read the variant's Dice."""
    command = list(variant.command)
    run_dir = runs / f"{variant.name}-{tag}"
    if variant.train_py:
        command += [f"--federation.output_dir={runs}", f"--federation.run_name={run_dir.name}"]
        command += ["--federation.progress=false"]
    log = logs / f"{variant.name}.{tag}.log"
    busy = idle_check(f"{variant.name} {tag}")
    with open(log, "wb") as fh:
        start = time.monotonic()
        proc = subprocess.run(command, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
        wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{variant.name} {tag} failed (rc={proc.returncode}): {shlex.join(command)}; see {log}")
    found = result_json(log)
    if variant.train_py:
        found = {**found, **read_run_dir(run_dir)}
        if not args.keep_runs:
            shutil.rmtree(run_dir, ignore_errors=True)
    run = Run(variant.name, tag, wall, busy, found.get("final_dice"), found.get("final_pooled_dice"), log=str(log))
    run.rounds_s = found.get("rounds_s")
    run.extra = {k: v for k, v in found.items() if k in ("round_s", "round_dice", "import_s", "setup_s", "script_s")}
    return run


def measure(found: list[Variant], args: argparse.Namespace, logs: Path, runs: Path) -> dict[str, list[Run]]:
    """Warm-up runs (uncounted), then the interleaved repeats; the counted runs per variant."""
    for w in range(args.warmup):
        for v in found:
            r = run_once(v, f"warmup{w + 1}", logs, runs, args)
            print(
                f"warm-up {w + 1}/{args.warmup}: {v.name:12s} {r.wall_s:7.2f} s  dice {fmt(r.final_dice)}", flush=True
            )
    counted: dict[str, list[Run]] = {v.name: [] for v in found}
    for i in range(args.repeats):
        for v in found:
            r = run_once(v, f"run{i + 1}", logs, runs, args)
            counted[v.name].append(r)
            print(f"run {i + 1}/{args.repeats}: {v.name:12s} {r.wall_s:7.2f} s  rounds {fmt(r.rounds_s, 2)} s  "
                  f"dice {fmt(r.final_dice)}  (busy before {r.busy_cores_before:.2f})", flush=True)  # fmt: skip
    return counted


# ------------------------------------------------------------------------------------------------- reporting


def fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def git(*words: str) -> str:
    out = subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 else "?"


def machine() -> str:
    """Cores and CPU model."""
    model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"nproc {usable} (of {os.cpu_count()}), {model}, {platform.system()} {platform.release()}"


def header(args: argparse.Namespace, overrides: list[str], found: list[Variant]) -> list[str]:
    """Date, commit, machine, command line, workload and each variant's command."""
    commit = git("rev-parse", "--short", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " (working tree has uncommitted changes)"
    _, ignored = raw_flags(overrides)
    lines = [
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"commit: {commit}",
        f"machine: {machine()}",
        f"command: {shlex.join(sys.orig_argv)}",
        f"workload: {config_path(args.config)} with {shlex.join(overrides) or 'no overrides'}; "
        f"{args.warmup} warm-up + {args.repeats} counted run(s) of each variant, interleaved",
    ]
    if ignored:
        lines.append(f"not given to raw (train.py only): {shlex.join(ignored)}")
    lines.append("variants (train.py ones also get --federation.output_dir=<tmp> --federation.run_name=<unique>"
                 " --federation.progress=false):")  # fmt: skip
    lines += [f"  {v.name}: {shlex.join(v.command)}" for v in found]
    return lines


def ratios(a: list[Run], b: list[Run]) -> tuple[float, float, list[float]]:
    """Ratio of median walls, median of per-repeat ratios, and the per-repeat ratios of ``a`` over ``b``."""
    per = [x.wall_s / y.wall_s for x, y in zip(a, b)]
    med = statistics.median(r.wall_s for r in a) / statistics.median(r.wall_s for r in b)
    return med, statistics.median(per), per


def row(name: str, runs: list[Run], base: list[Run] | None) -> str:
    """One variant's table row."""
    walls = [r.wall_s for r in runs]
    spread = f"{min(walls):.2f} / {statistics.median(walls):.2f} / {max(walls):.2f} s"
    rounds = [r.rounds_s for r in runs if r.rounds_s is not None]
    in_run = f"{statistics.median(rounds):.2f} s" if rounds else "-"
    ratio, per_text = "-", "-"
    if base and name != "raw":
        med, per_med, per = ratios(runs, base)
        ratio, per_text = f"{med:.2f} [{per_med:.2f}]", ", ".join(f"{x:.2f}" for x in per)
    elif base:
        ratio = "1.00"
    dice = " ".join(sorted({fmt(r.final_dice) for r in runs}))
    pooled = " ".join(sorted({fmt(r.pooled_dice) for r in runs}))
    return f"| {name} | {spread} | {in_run} | {ratio} | {per_text} | {dice} | {pooled} |"


def dice_gap(runs: list[Run], base: list[Run]) -> float | None:
    """The largest |final Dice - raw's final Dice| over the repeats (None if either has no Dice)."""
    gaps = [abs(r.final_dice - b.final_dice) for r, b in zip(runs, base) if None not in (r.final_dice, b.final_dice)]
    return max(gaps) if gaps else None


def table(counted: dict[str, list[Run]]) -> list[str]:
    """The Markdown table of whole-process times, ratios to raw and final Dice; the Dice gaps; the idle check."""
    base = counted.get("raw")
    lines = [
        "| variant | whole process min / median / max | rounds (in-run), median | / raw: medians [per-repeat median]"
        " | per-repeat / raw | final dice (client mean) | pooled dice |",
        "|---|---|---|---|---|---|---|",
        *(row(name, runs, base) for name, runs in counted.items()),
        "",
    ]
    for name, runs in counted.items():
        gap = dice_gap(runs, base) if base and name != "raw" else None
        if gap is not None:
            lines.append(f"{name}: final dice differs from raw's by at most {gap:.2e}")
    busiest = max(r.busy_cores_before for runs in counted.values() for r in runs)
    lines.append(f"idle check: at most {busiest:.2f} cores busy before a counted run")
    return lines


def main() -> None:
    args = parse_args()
    overrides = train_overrides(args)
    found = variants(args, overrides)
    top = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="medical-speed-"))
    stamp = time.strftime("%Y%m%dT%H%M%S")
    logs, runs = top / stamp / "logs", top / stamp / "runs"
    logs.mkdir(parents=True, exist_ok=True)
    runs.mkdir(parents=True, exist_ok=True)
    head = header(args, overrides, found)
    print("\n".join(head), flush=True)
    counted = measure(found, args, logs, runs)
    print("\n" + "\n".join(head + [""] + table(counted)))
    print(f"\nlogs in {logs}")
    if args.json:
        payload = {"header": head, "runs": {n: [asdict(r) for r in rs] for n, rs in counted.items()}}
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"timings in {args.json}")


if __name__ == "__main__":
    main()
