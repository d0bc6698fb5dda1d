"""ManyDigitsFederated: any number of digit clients, each drawn and augmented its own seeded way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules.many_digits import ManyDigitsFederated, augment, client_sizes, split_pool


def test_pools_are_disjoint_stratified_and_seeded():
    labels = np.repeat(np.arange(10), 30)
    train, test = split_pool(labels, 0.2, seed=0)
    for c in range(10):
        assert len(test[c]) == 6 and len(train[c]) == 24
        assert not set(train[c]) & set(test[c]) and set(train[c]) | set(test[c]) == set(np.flatnonzero(labels == c))
    again = split_pool(labels, 0.2, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(train + test, again[0] + again[1]))


def test_sizes_spread_and_have_a_floor():
    sizes = client_sizes(1000, 40, 0.5, np.random.default_rng(0), minimum=2)
    assert sizes.min() >= 2 and 30 <= np.median(sizes) <= 50 and sizes.max() > 80
    assert (client_sizes(5, 40, 0.0, np.random.default_rng(0), 2) == 40).all()


def test_augmentation_stays_in_range_and_shifts_with_zero_fill():
    images = torch.zeros(4, 1, 8, 8)
    images[:, :, 3, 3] = 1.0
    out = augment(images, 2, torch.Generator().manual_seed(0), (1.0, 0.0, 0.0))
    assert out.shape == images.shape and out.min() >= 0 and out.max() <= 1
    assert (out.flatten(1).sum(1) == 1).all()  # the pixel moved, nothing wrapped or duplicated
    assert len({tuple(torch.nonzero(o[0])[0].tolist()) for o in out}) > 1  # different shifts per image


def test_clients_are_seeded_and_independent_of_the_number_of_clients():
    small = ManyDigitsFederated(num_clients=4, image_size=8, seed=3)
    large = ManyDigitsFederated(num_clients=60, image_size=8, seed=3)
    assert large.client_ids[:4] == small.client_ids == ["site0", "site1", "site2", "site3"]
    for cid in small.client_ids:
        a, b = small.client_data(cid), large.client_data(cid)
        assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
        assert len(a.test_y) >= 1 and a.train_x.dtype == torch.float32 and a.train_x.shape[1:] == (1, 8, 8)
    assert not torch.equal(small.client_data("site0").train_x[:2], small.client_data("site1").train_x[:2])
    other = ManyDigitsFederated(num_clients=4, image_size=8, seed=4)
    assert not torch.equal(other.client_data("site0").train_x, small.client_data("site0").train_x)
    assert small.num_classes == 10 and small.label_counts("site0").sum() == small.num_train_samples("site0")


def test_label_skew_follows_alpha():
    skewed = ManyDigitsFederated(num_clients=30, image_size=8, alpha=0.1, samples_per_client=60, size_sigma=0)
    even = ManyDigitsFederated(num_clients=30, image_size=8, alpha=None, samples_per_client=60, size_sigma=0)

    def top_share(data):
        return np.mean([float(data.label_counts(c).max()) / data.num_train_samples(c) for c in data.client_ids])

    assert top_share(skewed) > 0.5 > top_share(even)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"num_clients": 0}, "num_clients"), ({"alpha": 0.0}, "alpha"), ({"max_shift": 16}, "max_shift")],
)
def test_invalid_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ManyDigitsFederated(**kwargs)
