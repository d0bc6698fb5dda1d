"""How many torch threads each of a sweep's processes runs with."""

from __future__ import annotations

import os


def worker_threads(count: int) -> str:
    """Each of ``count`` workers' torch threads: ``OMP_NUM_THREADS`` if set, else an equal share of the cores.

    Two workers on two cores, each with torch's default of one thread per core, run a trial ~6x slower than one
    worker alone (the threads wait on each other); shared out, they run as fast as the cores allow. The best
    configuration's re-runs use the same count: float sums depend on it.
    """
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // count))
