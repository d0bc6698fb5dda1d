"""A stand-in for ``torchrun`` in tests: ranks 0 … N − 1 as spawned processes, each running a function.

Not the product's launcher (that is :mod:`fl_lightning.engines.local_ranks`, one function for ``train.py`` and
``main()``): this runs many jobs on one pair of ranks, so the distributed tests pay the ranks' start-up once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from fl_lightning.engines.local_ranks import free_port
from fl_lightning.errors import RankError


def spawn(fn: Callable[..., None], world_size: int, args: tuple[Any, ...]) -> None:
    """Run ``fn(*args)`` in ``world_size`` new processes with torchrun's variables (one group on 127.0.0.1).

    Raises:
        RankError: If a rank raised or died, naming it.
    """
    port = free_port()
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // world_size)
    try:
        mp.start_processes(
            _spawned, args=(world_size, port, threads, fn, args), nprocs=world_size, start_method="spawn", join=True
        )
    except mp.ProcessRaisedException as err:
        raise RankError(f"rank {err.error_index} failed:\n{err}") from None
    except mp.ProcessExitedException as err:
        raise RankError(f"rank {err.error_index} died: {err}") from None


def _spawned(rank: int, world_size: int, port: int, threads: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads),
    )  # fmt: skip
    torch.set_num_threads(threads)
    fn(*args)
