"""W1 through our Flower ServerApp/ClientApp on Flower's Simulation Engine; prints a RESULT_JSON line for bench.py.

Usage (any python3; the run itself uses ``$FL_PROJECT/.venv/bin/python``, which needs the ``flower-sim`` extra):

    FL_PROJECT=<project root> python3 benchmarks/flower_w1.py [W1.yaml] [--supernodes 10] [--client-cpus 1]
        [extra train.py overrides...]

The side-by-side variant of ``/work/shared/bench``'s ``flower-cpus1`` anchor: 10 virtual SuperNodes (one client
each), Ray actors of 1 CPU, the ServerApp in the driver process (``python -m fl_lightning.engines.flower_sim``).
As an ``--extra`` of ``run.sh`` (which runs it with the bench folder as working directory and times the whole
process)::

    FL_PROJECT=$PWD ../shared/bench/run.sh -n 3 --only raw,flower-cpus1 \\
        --extra fl-flower="python3 $PWD/benchmarks/flower_w1.py"

The W1 config defaults to ``$FL_PROJECT/../shared/bench/fl_w1.yaml``. What it prints comes from the run
directory, as ``fl_w1.py``'s: ``rounds_s`` = sum of ``time/round``; ``final_acc`` = the clients' final global
accuracies weighted by their test samples (the pooled accuracy: a Flower server gets no test predictions, so
``summary.json`` has no pooled entry).
"""

import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

project = Path(os.environ.get("FL_PROJECT") or Path(__file__).resolve().parents[1]).resolve()
args = sys.argv[1:]
config = project.parent / "shared" / "bench" / "fl_w1.yaml"
if args and not args[0].startswith("-"):
    config = Path(args.pop(0)).resolve()


def take(flag: str, default: str) -> str:
    """Remove ``flag VALUE`` (or ``flag=VALUE``) from ``args``; its value, else ``default``."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(flag + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return default


supernodes, cpus = take("--supernodes", "10"), take("--client-cpus", "1")
python = project / ".venv" / "bin" / "python"
if not python.exists():
    sys.exit(f"no {python}: set FL_PROJECT to the project root (its .venv needs the flower-sim extra)")
if not config.exists():
    sys.exit(f"no W1 config at {config} (pass its path as the first argument)")
out = Path(tempfile.mkdtemp(prefix="w1flower-"))
cmd = [str(python), "-m", "fl_lightning.engines.flower_sim", "--num-supernodes", supernodes, "--client-cpus", cpus,
       "--state-dir", str(out / "site-state"), "--config", str(config), f"--federation.output_dir={out}",
       "--federation.run_name=w1", *args]  # fmt: skip
env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0"}
log = out / "run.log"
with open(log, "wb") as fh:
    done = subprocess.run(cmd, cwd=project, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
if done.returncode != 0:
    sys.stderr.write(log.read_text(errors="replace")[-6000:])
    sys.exit(f"the simulation failed (rc={done.returncode}); log: {log}")
run = out / "w1"
rounds = list(csv.DictReader(open(run / "rounds.csv")))
summary = json.loads((run / "summary.json").read_text())
clients = summary["clients"].values()
tested = [(c["global"]["acc"], c["test_samples"]) for c in clients if c.get("test_samples") and "global" in c]
acc = sum(a * n for a, n in tested) / sum(n for _, n in tested) if tested else None
times = [float(r["time/round"]) for r in rounds]
print("RESULT_JSON " + json.dumps({
    "impl": f"fl-flower-cpus{cpus}", "supernodes": int(supernodes),
    "rounds_s": sum(times), "round1_s": times[0], "round_s": times,
    "steady_round_s": sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else None,
    "final_acc": acc, "eval_s": [float(r["time/eval"]) for r in rounds], "run_dir": str(run),
}))  # fmt: skip
