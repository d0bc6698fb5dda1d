"""SCAFFOLD, FedNova and FedOpt math against hand computations on tiny tensors."""

import numpy as np
import pytest
import torch

from fl_lightning.ops.fednova import normalized_update, normalizing_factor, server_step
from fl_lightning.ops.fedopt import fedopt_step
from fl_lightning.ops.scaffold import client_control, correct_gradients, server_control


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_scaffold_controls_by_hand():
    c, c_i = {"w": t(0.5, -1.0)}, {"w": t(0.25, 0.0)}
    w, w_i = {"w": t(1.0, 2.0)}, {"w": t(0.5, 3.0)}
    new = client_control(c_i, c, w, w_i, steps=4, lr=0.1)
    torch.testing.assert_close(new["w"], t(0.25 - 0.5 + 0.5 / 0.4, 0.0 + 1.0 - 1.0 / 0.4))
    torch.testing.assert_close(server_control(c, {"w": t(2.0, 4.0)}, num_clients=8)["w"], t(0.75, -0.5))
    p = torch.nn.Parameter(t(1.0, 1.0))
    p.grad = t(0.1, 0.2)
    correct_gradients([p], [c["w"] - c_i["w"]])
    torch.testing.assert_close(p.grad, t(0.35, -0.8))
    with pytest.raises(ValueError, match="positive"):
        client_control(c_i, c, w, w_i, steps=0, lr=0.1)


def test_fednova_factor_and_step_by_hand():
    assert normalizing_factor(5) == 5.0
    rho, tau = 0.9, 3
    assert normalizing_factor(tau, rho) == pytest.approx((tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho))
    # with momentum the effective steps of 3 momentum-SGD steps: 1 + (1+ρ) + (1+ρ+ρ²)
    assert normalizing_factor(3, rho) == pytest.approx(1 + (1 + rho) + (1 + rho + rho**2))
    w = {"w": t(1.0, 1.0)}
    d1 = normalized_update(w, {"w": t(0.0, 1.0)}, a=2.0)
    d2 = normalized_update(w, {"w": t(1.0, -1.0)}, a=4.0)
    torch.testing.assert_close(d1["w"], t(0.5, 0.0))
    p = [0.25, 0.75]
    mean = {"w": p[0] * d1["w"] + p[1] * d2["w"]}
    tau_eff = p[0] * 2 + p[1] * 4
    torch.testing.assert_close(server_step(w, mean, tau_eff)["w"], t(1 - 3.5 * 0.125, 1 - 3.5 * 0.375))


def test_fednova_with_equal_steps_is_the_weighted_average():
    gen = torch.Generator().manual_seed(0)
    w = {"w": torch.randn(6, generator=gen, dtype=torch.float64)}
    locals_ = [{"w": torch.randn(6, generator=gen, dtype=torch.float64)} for _ in range(3)]
    p = [0.2, 0.3, 0.5]
    a = normalizing_factor(7, 0.5)
    mean = {"w": sum(pi * normalized_update(w, wi, a)["w"] for pi, wi in zip(p, locals_))}
    torch.testing.assert_close(server_step(w, mean, a)["w"], sum(pi * wi["w"] for pi, wi in zip(p, locals_)))


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_fedopt_step_by_hand(kind):
    w, delta = np.array([1.0, -2.0]), np.array([0.3, -0.1])
    m0, v0 = np.array([0.1, 0.0]), np.array([0.04, 0.02])
    lr, b1, b2, eps = 0.01, 0.9, 0.99, 1e-3
    m = b1 * m0 + (1 - b1) * delta
    if kind == "adam":
        v = b2 * v0 + (1 - b2) * delta**2
    elif kind == "yogi":
        v = v0 - (1 - b2) * delta**2 * np.sign(v0 - delta**2)
    else:
        v = v0 + delta**2
    expected = w + lr * m / (np.sqrt(v) + eps)
    got_w, got_m, got_v = fedopt_step(t(*w), t(*delta), t(*m0), t(*v0), kind, lr, b1, b2, eps)
    np.testing.assert_allclose(got_w.numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(got_m.numpy(), m, rtol=1e-12)
    np.testing.assert_allclose(got_v.numpy(), v, rtol=1e-12)
