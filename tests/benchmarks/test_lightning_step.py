"""The Lightning floor benchmark times real work: every short fit on the shared Trainer runs its steps."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import lightning_step  # noqa: E402

WORKLOADS = pytest.mark.parametrize("make", list(lightning_step.WORKLOADS.values()), ids=list(lightning_step.WORKLOADS))


PATHS = {
    "fits of their own": lightning_step.lightning_fits,
    "round fit, Lightning's loop": partial(lightning_step.lightning_round_fit, client_loop=False),
    "round fit, client loop": partial(lightning_step.lightning_round_fit, client_loop=True),
}


@WORKLOADS
@pytest.mark.parametrize("path", list(PATHS))
def test_every_fit_or_client_on_the_one_trainer_runs_its_steps(
    make: Callable[[], lightning_step.Workload], path: str
) -> None:
    """Four clients of three steps: in four fits of their own, or in one round fit of either loop."""
    workload = make()
    before = [p.detach().clone() for p in workload.module.parameters()]
    seconds, steps = PATHS[path](workload.module, workload.loader(3), 4)
    assert steps == 4 * 3
    assert seconds > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, workload.module.parameters(), strict=True))


@WORKLOADS
def test_the_plain_fit_runs_one_pass_that_trains_the_net(make: Callable[[], lightning_step.Workload]) -> None:
    workload = make()
    data = workload.loader(7)
    assert len(data) == 7
    before = [p.detach().clone() for p in workload.module.net.parameters()]
    assert lightning_step.plain_fit(workload.module.net, workload.lr, data) > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, workload.module.net.parameters(), strict=True))


def test_w1_is_the_shared_benchmarks_step() -> None:
    hp = lightning_step.w1_workload().module.hparams
    assert (tuple(hp.image_size), hp.norm, hp.lr, hp.momentum) == ((32, 32), "none", 0.05, 0.0)
