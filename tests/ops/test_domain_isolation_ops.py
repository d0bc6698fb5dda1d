"""Deep Domain Isolation's math: per-sample gradients, pruning, federated EM, affinity/linking, CFL splits."""

import numpy as np
import pytest
import torch
from sklearn.mixture import GaussianMixture
from torch import nn

from fl_lightning.ops.cfl import bipartition, split_criterion
from fl_lightning.ops.federated_gmm import client_statistics, federated_em, federated_kmeans_init
from fl_lightning.ops.linking import affinity, spectral_partition
from fl_lightning.ops.per_sample_grads import (
    class_restricted_gradients,
    normalise_rows,
    per_class_losses,
    prune_indices,
)


def tiny_segmenter():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True), nn.ReLU(), nn.Conv2d(4, 3, 1)
    )


def test_vmap_gradients_equal_a_per_sample_loop():
    model = tiny_segmenter()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 1, 8, 8, generator=gen)
    y = torch.randint(0, 3, (5, 8, 8), generator=gen)
    y[0][y[0] == 2] = 1  # sample 0 has no class 2
    grads = class_restricted_gradients(model, x, y, 3, chunk_size=2)
    assert grads.shape == (5, 3, sum(p.numel() for p in model.parameters()))
    model.eval()
    for a in range(5):
        for c in range(3):
            if not (y[a] == c).any():
                assert torch.equal(grads[a, c], torch.zeros_like(grads[a, c]))
                continue
            model.zero_grad()
            per_class_losses(model(x[a : a + 1])[0], y[a], 3)[c].backward()
            reference = torch.cat([p.grad.flatten() for p in model.parameters()])
            torch.testing.assert_close(grads[a, c], reference, atol=1e-6, rtol=1e-5)


def test_class_restriction_uses_only_that_class_pixels():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 4, generator=gen)
    mask = torch.randint(0, 3, (4, 4), generator=gen)
    logp = torch.log_softmax(logits, 0)
    for c in range(3):
        expected = -logp[c][mask == c].mean()
        torch.testing.assert_close(per_class_losses(logits, mask, 3)[c], expected)
    # changing every logit of the pixels that are not of class 1 leaves class 1's loss unchanged
    only_c1 = logits.clone()
    only_c1[:, mask != 1] = torch.randn_like(only_c1[:, mask != 1])  # pixels not of class 1 changed
    torch.testing.assert_close(per_class_losses(only_c1, mask, 3)[1], per_class_losses(logits, mask, 3)[1])


def test_pruning_is_seeded_and_normalisation_gives_unit_rows():
    a, b, c = prune_indices(1000, 0.01, seed=7), prune_indices(1000, 0.01, seed=7), prune_indices(1000, 0.01, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)  # same coordinates on every client for a seed
    assert len(a) == 10 and len(set(a.tolist())) == 10 and bool((a[1:] > a[:-1]).all())
    with pytest.raises(ValueError, match="prune_fraction"):
        prune_indices(10, 0.0, 0)
    v = normalise_rows(torch.randn(4, 6, dtype=torch.float64))
    torch.testing.assert_close(v.norm(dim=1), torch.ones(4, dtype=torch.float64))


def test_federated_em_equals_sklearn_diagonal_gmm_on_pooled_data():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(70, 4, generator=gen, dtype=torch.float64) * 0.5 + 2,
            torch.randn(50, 4, generator=gen, dtype=torch.float64) * 0.3 - 1,
            torch.randn(40, 4, generator=gen, dtype=torch.float64) * 0.8 + torch.tensor([3.0, -3, 0, 1]),
        ]
    )
    clients = [x[:30], x[30:100], x[100:]]
    init = federated_kmeans_init(clients, 3, seed=0)
    ours, iterations = federated_em(clients, init, max_iter=200, tol=1e-6)
    sk = GaussianMixture(
        3, covariance_type="diag", weights_init=init.weights.numpy(), means_init=init.means.numpy(),
        precisions_init=(1 / init.variances).numpy(), tol=1e-6, max_iter=200, reg_covar=1e-6,
    ).fit(x.numpy())  # fmt: skip
    np.testing.assert_allclose(ours.means.numpy(), sk.means_, atol=1e-6)
    np.testing.assert_allclose(ours.variances.numpy(), sk.covariances_, atol=1e-6)
    np.testing.assert_allclose(ours.weights.numpy(), sk.weights_, atol=1e-6)
    assert iterations == sk.n_iter_


def test_client_messages_hold_only_statistics():
    x = torch.randn(25, 3, dtype=torch.float64)
    init = federated_kmeans_init([x], 2, seed=0)
    message = client_statistics(x, init)
    assert set(message) == {"n_k", "s1", "s2", "log_likelihood", "n"}
    assert all(v.numel() <= 2 * 3 for v in message.values())  # K·D at most: no per-sample data


def test_affinity_and_linking_by_hand():
    # 3 samples, 2 classes, K = 2; sample 2 lacks class 0, sample 0 lacks class 1
    g0 = torch.tensor([[1.0, 0.0], [0.8, 0.2], [0.0, 0.0]])
    g1 = torch.tensor([[0.0, 0.0], [0.5, 0.5], [0.1, 0.9]])
    p0, p1 = torch.tensor([True, True, False]), torch.tensor([False, True, True])
    s = affinity([g0, g1], [p0, p1])
    expected = torch.tensor(
        [
            [1.0, 0.8, 0.0],  # 0-1 share class 0 only; 0-2 share nothing
            [0.8, (0.68 + 0.5) / 2, 0.5 * 0.1 + 0.5 * 0.9],
            [0.0, 0.5, 0.82],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(s, expected)


def test_spectral_clustering_partitions_all_samples():
    block = torch.block_diag(torch.full((4, 4), 0.9), torch.full((3, 3), 0.9)).double() + 0.05
    labels = spectral_partition(block, 2, seed=0)
    assert labels.shape == (7,) and set(labels.tolist()) == {0, 1}
    assert len(set(labels[:4])) == 1 and len(set(labels[4:])) == 1 and labels[0] != labels[4]


def test_cfl_criterion_and_bipartition():
    a = torch.tensor([1.0, 0.0, 0.0])
    updates = torch.stack([a, a * 1.1, -a, -a * 0.9]) * 2
    w = torch.full((4,), 0.25)
    assert split_criterion(updates, w, eps1=0.4, eps2=1.6)  # mean ≈ 0, clients far apart
    assert not split_criterion(updates, w, eps1=0.4, eps2=5.0)
    halves = bipartition(updates)
    assert sorted(map(sorted, halves)) == [[0, 1], [2, 3]]
    same = torch.stack([a, a * 2, a * 0.5])
    assert bipartition(same) is None  # identical directions are never split
    assert not split_criterion(torch.stack([a, a]), torch.tensor([0.5, 0.5]), 0.4, 1.6)
