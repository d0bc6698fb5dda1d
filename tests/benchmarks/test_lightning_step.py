"""The Lightning floor benchmark times real work: every short fit on the shared Trainer runs its steps."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import lightning_step  # noqa: E402


def test_every_fit_on_the_one_trainer_runs_its_steps() -> None:
    seconds, steps = lightning_step.lightning_fits(lightning_step.loader(3), fits=4)
    assert steps == 4 * 3
    assert seconds > 0


def test_the_plain_fit_runs_one_pass() -> None:
    assert len(lightning_step.loader(7)) == 7
    assert lightning_step.plain_fit(lightning_step.loader(2)) > 0
