"""seeded_rng: the block's draws are a function of its seed; the outer draws go on as if it had not run."""

import random

import numpy as np
import pytest
import torch

from fl_lightning.ops.rng import seeded_rng


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_the_block_draws_depend_on_its_seed_only():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    with seeded_rng(7):
        first = _draw()
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    _draw()  # whatever ran before
    with seeded_rng(7):
        again = _draw()
    with seeded_rng(8):
        other = _draw()
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    assert first[:2] != other[:2] and not torch.equal(first[2], other[2])


def test_the_outer_stream_goes_on_as_if_the_block_had_not_run_even_when_it_raises():
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    want = _draw()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    with pytest.raises(RuntimeError), seeded_rng(5):
        _draw()
        raise RuntimeError("inside")
    got = _draw()
    assert want[:2] == got[:2] and torch.equal(want[2], got[2])


def test_a_seed_above_numpys_limit_is_accepted():
    with seeded_rng(2**63 - 1):
        assert 0.0 <= np.random.rand() < 1.0
