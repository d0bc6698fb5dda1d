"""Embedded digit segmentation: masks match the digits, three per image, styles per site, inverted domain, seeded."""

import numpy as np
import pytest
import torch

from datamodules import DigitsSegFederated
from datamodules.digits_seg import SEG_DIGITS, compose


def seg(**kwargs):
    args = {"num_clients": 3, "image_size": 16, "num_samples": 90, "seed": 0}
    return DigitsSegFederated(**{**args, **kwargs})


def test_shapes_classes_and_loaders():
    dm = seg()
    assert dm.client_ids == ["site0", "site1", "site2"]
    assert dm.num_classes == len(SEG_DIGITS) + 1 == 5
    assert dm.in_channels == 1 and dm.image_size == (16, 16)
    for cid in dm.client_ids:
        d = dm.client_data(cid)
        assert d.train_x.shape[1:] == (1, 16, 16) and d.train_x.dtype == torch.float32
        assert d.train_y.shape == (len(d.train_x), 16, 16) and d.train_y.dtype == torch.int64
        assert d.test_y.shape == (len(d.test_x), 16, 16)
        assert 0 <= int(d.train_y.min()) and int(d.train_y.max()) <= 4
        counts = dm.label_counts(cid)  # pixels per class
        assert counts.shape == (5,) and int(counts.sum()) == d.train_y.numel()
    x, y = next(iter(dm.client_train_loader("site0")))
    assert x.shape == (16, 1, 16, 16) and y.shape == (16, 16, 16)


def test_masks_are_the_bright_digit_pixels_three_digits_per_image():
    dm = seg(site_styles=False, image_size=32)
    d = dm.client_data("site1")
    x, y = d.train_x[:, 0], d.train_y
    assert torch.equal(y > 0, x > 0.3)  # unstyled: the mask is exactly the digit strokes
    quadrants = y.view(-1, 2, 16, 2, 16).amax((2, 4)) > 0  # which quadrants hold a digit
    assert (quadrants.sum((1, 2)) == 3).all()
    assert set(torch.unique(y).tolist()) == {0, 1, 2, 3, 4}


def test_every_site_has_its_own_style_and_data_is_seeded():
    a, b = seg(), seg()
    for cid in a.client_ids:
        assert torch.equal(a.client_data(cid).train_x, b.client_data(cid).train_x)
        assert torch.equal(a.client_data(cid).test_y, b.client_data(cid).test_y)
    assert not torch.equal(seg(seed=1).client_data("site0").train_y, a.client_data("site0").train_y)
    plain = seg(site_styles=False)
    styled_means = [float(a.client_data(c).train_x.mean()) for c in a.client_ids]
    assert styled_means[2] > 0.5  # site 2's style inverts intensities
    assert torch.equal(plain.client_data("site0").train_x, a.client_data("site0").train_x)  # site 0 is clean
    assert not torch.equal(plain.client_data("site1").train_x, a.client_data("site1").train_x)
    assert torch.equal(plain.client_data("site1").train_y, a.client_data("site1").train_y)  # styles keep masks


def test_inverted_domain_and_domain_partition():
    dm = seg(num_clients=4, inverted_fraction=0.5, partition="domain", site_styles=False)
    for i, cid in enumerate(dm.client_ids):
        d = dm.client_data(cid)
        assert set(d.train_domain.tolist()) == set(d.test_domain.tolist()) == {i % 2}
        x, y = d.train_x[:, 0], d.train_y
        bright = x > 0.3 if i % 2 == 0 else x < 0.7  # inverted: digits are the dark pixels
        assert torch.equal(y > 0, bright)
    mixed = seg(inverted_fraction=0.5)
    domains = torch.cat([mixed.client_data(c).train_domain for c in mixed.client_ids])
    assert 0.3 < float(domains.float().mean()) < 0.7
    assert set(seg().client_data("site0").train_domain.tolist()) == {0}


def test_three_channels():
    dm = seg(channels=3)
    assert dm.in_channels == 3 and dm.client_data("site1").train_x.shape[1] == 3


def test_compose_uses_only_its_pool():
    scans = torch.rand(10, 1, 4, 4)
    classes = np.arange(10) % 4 + 1
    image, mask = compose(scans, classes, np.array([7]), image_size=12, seed=3)
    assert set(torch.unique(mask).tolist()) <= {0, int(classes[7])}
    patches = image[0][mask > 0]
    assert set(patches.tolist()) <= set(scans[7].flatten().tolist())


def test_max_samples_per_client_and_errors():
    dm = seg(max_samples_per_client=10)
    assert all(dm.num_train_samples(c) + dm.num_test_samples(c) == 10 for c in dm.client_ids)
    with pytest.raises(ValueError, match="inverted_fraction"):
        seg(inverted_fraction=1.5)
    with pytest.raises(ValueError, match="partition"):
        seg(partition="dirichlet")
    with pytest.raises(ValueError, match="image_size"):
        seg(image_size=2)
