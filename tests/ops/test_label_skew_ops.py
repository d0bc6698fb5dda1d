"""Secure sum, priors, FedShift's shift and reweighting weights against hand computations."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fl_lightning.ops import secure_sum
from fl_lightning.ops.label_shift import global_prior, inverse_prior_weights, logit_shift, smoothed_prior
from fl_lightning.ops.moon import moon_contrastive_loss

IDS = ["a", "b", "c", "d"]


def test_masks_cancel_and_are_seeded():
    masks = secure_sum.pairwise_masks(IDS, 7, seed=3)
    assert torch.equal(sum(masks.values()), torch.zeros(7, dtype=torch.int64))
    again = secure_sum.pairwise_masks(IDS, 7, seed=3)
    assert all(torch.equal(masks[c], again[c]) for c in IDS)
    other = secure_sum.pairwise_masks(IDS, 7, seed=4)
    assert not any(torch.equal(masks[c], other[c]) for c in IDS)


def test_secure_sum_equals_plain_sum_and_hides_each_client():
    gen = torch.Generator().manual_seed(0)
    counts = {c: torch.randint(0, 50, (5,), generator=gen).double() for c in IDS}
    masks = secure_sum.pairwise_masks(IDS, 5, seed=1)
    uploads = {c: secure_sum.mask(v, masks[c]) for c, v in counts.items()}
    assert torch.equal(secure_sum.server_sum(uploads.values()), sum(counts.values()))
    for c in IDS:  # what the server receives says nothing useful about one client's counts
        raw = secure_sum.encode(counts[c])
        assert (uploads[c] - raw).abs().min() > 2**20
        assert not torch.allclose(secure_sum.decode(uploads[c]), counts[c], atol=1e3)


def test_fixed_point_round_trip():
    x = torch.tensor([0.1, 1 / 3, 123.456], dtype=torch.float64)
    assert torch.allclose(secure_sum.decode(secure_sum.encode(x)), x, atol=2**-24)


def test_priors_shift_and_weights_by_hand():
    counts = [np.array([8, 0, 2]), np.array([1, 5, 4])]
    pri = [(c + 1) / (c.sum() + 3) for c in counts]
    n = [c.sum() for c in counts]
    glob = (n[0] * pri[0] + n[1] * pri[1]) / sum(n)
    for c, p in zip(counts, pri):
        torch.testing.assert_close(smoothed_prior(torch.tensor(c)), torch.tensor(p, dtype=torch.float64))
        shift = logit_shift(torch.tensor(p), torch.tensor(glob), tau=0.7)
        torch.testing.assert_close(shift, torch.tensor(0.7 * (np.log(p) - np.log(glob)), dtype=torch.float64))
    weighted = sum(torch.tensor(ni * p) for ni, p in zip(n, pri))
    torch.testing.assert_close(global_prior(weighted, float(sum(n))), torch.tensor(glob, dtype=torch.float64))
    w = inverse_prior_weights(torch.tensor(counts[0]))
    expected = 1 / pri[0]
    expected = expected / expected[counts[0] > 0].mean()
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))
    assert w[counts[0] > 0].mean().item() == pytest.approx(1.0)


def test_equal_priors_give_zero_shift_and_balanced_data_uniform_weights():
    p = smoothed_prior(torch.tensor([3, 3, 3]))
    assert torch.equal(logit_shift(p, p), torch.zeros(3, dtype=torch.float64))
    assert torch.equal(inverse_prior_weights(torch.tensor([4, 4, 4, 4])), torch.ones(4, dtype=torch.float64))


def test_moon_loss_by_hand():
    gen = torch.Generator().manual_seed(0)
    z, zg, zp = (torch.randn(5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    t = 0.5

    def cos(a, b):
        return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))

    pos, neg = np.exp(cos(z, zg).numpy() / t), np.exp(cos(z, zp).numpy() / t)
    expected = np.mean(-np.log(pos / (pos + neg)))
    assert moon_contrastive_loss(z, zg, zp, t).item() == pytest.approx(expected, rel=1e-12)
    # identical previous and global representations: the term is the constant log 2
    assert moon_contrastive_loss(z, zg, zg, t).item() == pytest.approx(np.log(2))
    # the gradient pulls z towards z_g: one step lowers the loss
    zz = z.clone().requires_grad_(True)
    moon_contrastive_loss(zz, zg, zp, t).backward()
    assert moon_contrastive_loss(z - 0.1 * zz.grad, zg, zp, t) < moon_contrastive_loss(z, zg, zp, t)
    assert F.cosine_similarity(z - 0.1 * zz.grad, zg).mean() > F.cosine_similarity(z, zg).mean()
