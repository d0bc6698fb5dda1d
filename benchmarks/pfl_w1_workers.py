"""pfl-research's multi-worker simulation of W1: ``../shared/bench/pfl_sim.py`` on every torchrun worker.

pfl runs several workers through ``torch.distributed`` when started by torchrun (its ``PyTorchDistributedContext``):
each worker trains its share of the round's cohort and the model updates are all-reduced. This wrapper sets each
worker's torch threads (``PFL_THREADS``, default: the CPU cores shared out) and keeps the output of every worker but
rank 0 off stdout, so the side-by-side benchmark reads one result. pfl_sim's per-round check that every client was
drawn once holds for the whole cohort only, not for one worker's share, so it runs with assertions off
(``PYTHONOPTIMIZE=1``); a client's batch order then depends on how often that worker drew it, a different but
equally valid order.

    PYTHONOPTIMIZE=1 /tmp/pfl-venv/bin/torchrun --nproc_per_node 2 benchmarks/pfl_w1_workers.py
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

BENCH = Path(os.environ.get("FL_BENCH", Path(__file__).resolve().parents[2] / "shared" / "bench"))
sys.path.insert(0, str(BENCH))

import fedbench  # noqa: E402

world = int(os.environ.get("WORLD_SIZE", "1"))
fedbench.RAW_THREADS = int(os.environ.get("PFL_THREADS", "0")) or max(1, (os.cpu_count() or 1) // world)
if int(os.environ.get("RANK", "0")) != 0:
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this worker's life
sys.argv = [str(BENCH / "pfl_sim.py"), *sys.argv[1:]]
runpy.run_path(str(BENCH / "pfl_sim.py"), run_name="__main__")

import torch.distributed as dist  # noqa: E402

if dist.is_available() and dist.is_initialized():
    # pfl leaves its process group up; a gloo group torn down by the interpreter's exit can abort a worker
    # ("terminate called without an active exception"), which would fail the run after its result.
    dist.barrier()
    dist.destroy_process_group()
