"""The weight-perturbation math: δ = α g / ‖g‖ with one global norm; exact restore."""

import numpy as np
import torch

from fl_lightning.ops.sharpness import global_grad_norm, perturb, perturbation, restore


def test_perturbation_uses_one_global_norm():
    g = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0], [4.0]]), torch.tensor(12.0)]
    flat = np.concatenate([t.numpy().ravel() for t in g])
    assert float(global_grad_norm(g)) == np.linalg.norm(flat) == 13.0
    deltas = perturbation(g, alpha=0.5)
    for d, t in zip(deltas, g):
        np.testing.assert_allclose(d.numpy(), 0.5 * t.numpy() / (13.0 + 1e-12), rtol=1e-6)
        assert d.shape == t.shape
    total = np.linalg.norm(np.concatenate([d.numpy().ravel() for d in deltas]))
    np.testing.assert_allclose(total, 0.5, rtol=1e-6)  # the step has length α


def test_zero_gradient_gives_zero_perturbation():
    deltas = perturbation([torch.zeros(3)], alpha=0.05)
    assert torch.equal(deltas[0], torch.zeros(3))


def test_perturb_then_restore_is_exact_and_skips_parameters_without_gradient():
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(2, 2))
    a.grad = torch.randn(5)
    before_a, before_b = a.detach().clone(), b.detach().clone()
    saved = perturb([a, b], alpha=0.1)
    assert len(saved) == 1 and saved[0][0] is a
    torch.testing.assert_close(a.detach(), before_a + 0.1 * a.grad / (a.grad.norm() + 1e-12))
    assert torch.equal(b.detach(), before_b)
    a.grad = None  # the second pass may leave a different set of gradients; restore does not care
    restore(saved)
    assert torch.equal(a.detach(), before_a)
