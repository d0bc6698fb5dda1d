"""DigitsFederated's binary option: one digit against the rest, with a chosen share of positives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules import DigitsFederated
from datamodules.digits import binary_subsample


def all_labels(dm: DigitsFederated) -> torch.Tensor:
    return torch.cat([torch.cat([dm.client_data(c).train_y, dm.client_data(c).test_y]) for c in dm.client_ids])


def test_one_digit_against_the_rest_at_the_requested_fraction() -> None:
    dm = DigitsFederated(binary_positive=8, positive_fraction=0.15, seed=0)
    y = all_labels(dm)
    assert dm.num_classes == 2 and set(y.unique().tolist()) == {0, 1}
    # digit 8 has 174 scans, all kept; 986 of the 1,623 others: 174 / 1,160 = 0.15
    assert int(y.sum()) == 174 and len(y) == 1160
    assert dm.label_counts("site0").shape == (2,)


def test_without_a_fraction_every_scan_is_kept() -> None:
    dm = DigitsFederated(binary_positive=0, image_size=8)
    y = all_labels(dm)
    assert len(y) == 1797 and int(y.sum()) == 178


def test_subsample_is_seeded_and_the_ten_class_task_is_unchanged() -> None:
    a = DigitsFederated(binary_positive=3, positive_fraction=0.15, image_size=8, seed=0)
    b = DigitsFederated(binary_positive=3, positive_fraction=0.15, image_size=8, seed=0)
    c = DigitsFederated(binary_positive=3, positive_fraction=0.15, image_size=8, seed=1)
    assert torch.equal(a.client_data("site1").train_x, b.client_data("site1").train_x)
    assert not torch.equal(a.client_data("site1").train_y, c.client_data("site1").train_y)
    off, default = DigitsFederated(image_size=8, binary_positive=None), DigitsFederated(image_size=8)
    assert off.num_classes == 10
    for cid in default.client_ids:
        assert torch.equal(off.client_data(cid).train_x, default.client_data(cid).train_x)
        assert torch.equal(off.client_data(cid).test_y, default.client_data(cid).test_y)


def test_binary_subsample_keeps_the_smaller_side_whole() -> None:
    labels = np.array([1] * 10 + [0] * 90)
    keep = binary_subsample(labels, 0.2, seed=0)  # positives 10 < 20 %: keep them, 40 negatives
    assert labels[keep].sum() == 10 and len(keep) == 50 and np.all(np.diff(keep) > 0)
    keep = binary_subsample(labels, 0.05, seed=0)  # positives 10 > 5 %: keep the 90 negatives, 5 positives
    assert labels[keep].sum() == 5 and len(keep) == 95
    with pytest.raises(ValueError, match="both classes"):
        binary_subsample(np.zeros(5, dtype=np.int64), 0.5, seed=0)


def test_dirichlet_split_of_the_binary_task_loads() -> None:
    dm = DigitsFederated(
        binary_positive=8, positive_fraction=0.15, num_clients=10, partition="dirichlet", alpha=0.1, site_styles=False
    )
    assert len(dm.client_ids) == 10 and int(all_labels(dm).sum()) == 174


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"binary_positive": 10}, "binary_positive"),
        ({"positive_fraction": 0.15}, "needs binary_positive"),
        ({"binary_positive": 1, "positive_fraction": 1.0}, r"positive_fraction must be in \(0, 1\)"),
        ({"binary_positive": 1, "positive_fraction": 0.0}, r"positive_fraction must be in \(0, 1\)"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DigitsFederated(**kwargs)
