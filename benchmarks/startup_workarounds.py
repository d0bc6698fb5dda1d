"""What each start-up workaround saves of a whole process: ``python train.py --help`` with and without it.

The two workarounds in ``fl_lightning/startup/``: ``heap.long_lived`` (no cyclic collection while Lightning loads,
then ``gc.freeze``) and ``lean_imports`` (torchmetrics loads without ``scipy.signal``). Issue 40 keeps each only if
it saves at least 3 % of ``train.py --help`` (or of the medical-size run, where a second is ~3 %). The variants, each
a fresh process running ``train.py --help`` through ``runpy`` (so all pay the same wrapper):

* ``shipped``: as it is;
* ``no-lean-imports``: ``scipy.signal`` imported first (what torchmetrics does without the workaround; the
  workaround then stands aside, as it does whenever ``scipy.signal`` is already loaded);
* ``no-gc-freeze``: ``heap.long_lived`` replaced by a plain context (this harness's own change, in its child only).

Interleaved, after one uncounted round; prints the medians, each variant's ratio to ``shipped`` and the saving.

    python benchmarks/startup_workarounds.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = "import runpy, sys; sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__')"
VARIANTS = {
    "shipped": RUN,
    "no-lean-imports": "import scipy.signal; " + RUN,
    "no-gc-freeze": "import contextlib, fl_lightning.startup.heap as heap; heap.long_lived = contextlib.nullcontext; "
    + RUN,
}


def once(code: str) -> float:
    """Wall seconds of one fresh ``python -c code --help`` in the repository root."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", code, "--help"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", "-n", type=int, default=9)
    args = parser.parse_args()
    for code in VARIANTS.values():  # warm-up: file caches, bytecode
        once(code)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, code in VARIANTS.items():
            times[name].append(once(code))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; commit {commit.stdout.strip()}; "
          f"{platform.node()} ({len(__import__('os').sched_getaffinity(0))} cores); "
          f"command: python benchmarks/startup_workarounds.py --repeats {args.repeats}")  # fmt: skip
    base = statistics.median(times["shipped"])
    print("| variant | median s (min … max) | / shipped | the workaround saves |")
    print("|---|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        saving = "-" if name == "shipped" else f"{100 * (1 - base / med):.1f} % of the process without it"
        print(f"| {name} | {med:.2f} ({min(values):.2f} … {max(values):.2f}) | {med / base:.3f} | {saving} |")


if __name__ == "__main__":
    main()
