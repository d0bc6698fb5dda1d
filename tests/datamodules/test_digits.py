"""Embedded digits: shapes, labels, per-site styles, and data fixed across rounds and instances."""

from __future__ import annotations

import pytest
import torch

from datamodules import DigitsFederated
from datamodules.partition import PARTITION_SCHEMES


@pytest.fixture(scope="module")
def digits() -> DigitsFederated:
    return DigitsFederated(seed=0)


def test_shapes_ids_and_labels(digits: DigitsFederated) -> None:
    assert digits.client_ids == [f"site{i}" for i in range(5)]
    assert digits.num_classes == 10 and digits.in_channels == 1 and digits.image_size == (16, 16)
    total = 0
    for cid in digits.client_ids:
        data = digits.client_data(cid)
        assert data.train_x.shape[1:] == (1, 16, 16) and data.train_x.dtype == torch.float32
        assert data.train_y.dtype == torch.int64
        assert 0 <= data.train_y.min() and data.train_y.max() < 10
        assert data.train_x.min() >= 0 and data.train_x.max() <= 1
        assert digits.label_counts(cid).sum() == digits.num_train_samples(cid)
        assert digits.label_counts(cid, "test").shape == (10,)
        total += digits.num_train_samples(cid) + len(data.test_y)
        x, y = next(iter(digits.client_test_loader(cid)))
        assert x.shape[1:] == (1, 16, 16) and y.dtype == torch.int64
    assert total == 1797


def test_sites_have_different_pixel_statistics(digits: DigitsFederated) -> None:
    stats = torch.tensor(
        [[digits.client_data(c).train_x.mean(), digits.client_data(c).train_x.std()] for c in digits.client_ids]
    )
    distances = torch.cdist(stats, stats) + torch.eye(5)
    assert distances.min() > 0.01
    # Site 2 is the inverted one: mostly bright background.
    assert stats[2, 0] > 0.5 > stats[0, 0]
    assert torch.equal(digits.client_data("site3").train_domain.unique(), torch.tensor([3]))


def test_without_styles_sites_look_alike() -> None:
    plain = DigitsFederated(site_styles=False)
    means = torch.tensor([plain.client_data(c).train_x.mean() for c in plain.client_ids])
    assert means.max() - means.min() < 0.03


def test_client_data_identical_across_rounds_and_instances(digits: DigitsFederated) -> None:
    first = torch.cat([x for x, _ in digits.client_test_loader("site1")])
    second = torch.cat([x for x, _ in digits.client_test_loader("site1")])
    assert torch.equal(first, second)
    other = DigitsFederated(seed=0)
    for cid in digits.client_ids:
        a, b = digits.client_data(cid), other.client_data(cid)
        assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert not torch.equal(DigitsFederated(seed=1).client_data("site0").train_y, digits.client_data("site0").train_y)


def test_channels_3_and_image_size() -> None:
    dm = DigitsFederated(channels=3, image_size=12, num_clients=3)
    assert dm.in_channels == 3 and dm.image_size == (12, 12)
    x = dm.client_data("site1").train_x
    assert x.shape[1:] == (3, 12, 12)
    # Tinted: the channels of a tinted site differ.
    assert not torch.allclose(x[:, 0], x[:, 1])


@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_every_scheme_loads(scheme: str) -> None:
    dm = DigitsFederated(num_clients=6, partition=scheme, classes_per_client=3, image_size=8)
    assert len(dm.client_ids) == 6
    if scheme == "pathological":
        assert all((dm.label_counts(c) + dm.label_counts(c, "test") > 0).sum() == 3 for c in dm.client_ids)
    if scheme == "domain":
        # 6 clients over min(6, 5) = 5 domains: client i sees only domain i % 5.
        for i, cid in enumerate(dm.client_ids):
            assert set(dm.client_data(cid).train_domain.tolist()) == {i % 5}


def test_max_samples_per_client() -> None:
    dm = DigitsFederated(max_samples_per_client=50)
    for cid in dm.client_ids:
        assert dm.num_train_samples(cid) + len(dm.client_data(cid).test_y) == 50


def test_steps_loader_and_pooled_loaders(digits: DigitsFederated) -> None:
    assert len(list(digits.client_train_loader("site0", steps=2))) == 2
    pooled = sum(len(y) for _, y in digits.pooled_test_loader())
    assert pooled == sum(len(digits.client_data(c).test_y) for c in digits.client_ids)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"channels": 2}, "channels"), ({"partition": "bogus"}, "partition"), ({"num_clients": 0}, "num_clients")],
)
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        DigitsFederated(**kwargs)


def test_too_many_clients_names_a_client() -> None:
    with pytest.raises(ValueError, match=r"client \d+"):
        DigitsFederated(num_clients=40, partition="dirichlet", alpha=0.001).setup()
