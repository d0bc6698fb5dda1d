"""DP-FedAvg's pure maths against hand computations, NumPy references and Opacus' accountant used standalone."""

import math

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant

from fl_lightning.ops.dp_fedavg import (
    add_round,
    calibrate_noise_multiplier,
    clip_update,
    epsilon,
    fixed_denominator_mean,
    gaussian_noise,
    geometric_clip_update,
    noise_seed,
    noised_unclipped_fraction,
    private_state,
    update_noise_multiplier,
)


def test_an_update_above_the_bound_arrives_scaled_to_it():
    delta = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[0.0], [4.0]])}  # ‖Δ‖ = 5
    clipped, norm = clip_update(delta, 1.0)
    assert norm == 5.0
    assert torch.allclose(clipped["a"], torch.tensor([0.6, 0.0])) and torch.allclose(
        clipped["b"], torch.tensor([[0], [0.8]])
    )
    assert math.isclose(math.sqrt(sum(float((v**2).sum()) for v in clipped.values())), 1.0, rel_tol=1e-6)
    inside, _ = clip_update(delta, 5.0)  # on the sphere: unchanged
    assert all(torch.equal(inside[k], delta[k]) for k in delta)
    unbounded, _ = clip_update(delta, None)
    assert all(torch.equal(unbounded[k], delta[k]) for k in delta)


def test_the_sent_state_is_received_plus_the_clipped_update_and_buffers_go_back_as_received():
    received = {"w": torch.tensor([1.0, 1.0]), "buf": torch.tensor([7.0])}
    local = {"w": torch.tensor([4.0, 5.0]), "buf": torch.tensor([9.0])}  # Δ_w = (3, 4), ‖Δ‖ = 5
    out, norm = private_state(local, received, ["w"], clip_norm=2.5)
    assert norm == 5.0
    torch.testing.assert_close(out["w"], torch.tensor([2.5, 3.0]))
    assert torch.equal(out["buf"], received["buf"])
    same, _ = private_state(local, received, ["w"], clip_norm=None)  # inside the ball, no noise: as trained
    assert same["w"] is local["w"] and torch.equal(same["buf"], received["buf"])
    noised, _ = private_state(local, received, ["w"], clip_norm=None, noise_std=1.0, seed=3)
    torch.testing.assert_close(noised["w"] - local["w"], gaussian_noise({"w": local["w"]}, 1.0, 3)["w"])


def test_the_noise_std_matches_sigma_c_and_is_reproducible():
    sigma, c, n = 1.3, 0.7, 200_000
    noise = gaussian_noise({"x": torch.zeros(n // 2), "y": torch.zeros(n // 4, 2)}, sigma * c, seed=11)
    values = torch.cat([v.flatten() for v in noise.values()]).double()
    # sample std of n normal draws: standard error σ/√(2n); mean: σ/√n; 5 standard errors each
    assert abs(values.std().item() - sigma * c) < 5 * sigma * c / math.sqrt(2 * n)
    assert abs(values.mean().item()) < 5 * sigma * c / math.sqrt(n)
    again = gaussian_noise({"x": torch.zeros(n // 2), "y": torch.zeros(n // 4, 2)}, sigma * c, seed=11)
    assert all(torch.equal(noise[k], again[k]) for k in noise)
    assert not torch.equal(noise["x"], gaussian_noise({"x": torch.zeros(n // 2)}, sigma * c, seed=12)["x"])


def test_seeds_separate_rounds_clients_and_streams():
    seeds = {noise_seed(0, r, who, s) for r in (0, 1) for who in ("server", "c0", "c1") for s in ("update", "count")}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)


def test_fixed_denominator_counts_the_missing_clients_as_zero_updates():
    prev, mean = (
        {"w": torch.tensor([1.0]), "b": torch.tensor([0.0])},
        {"w": torch.tensor([3.0]), "b": torch.tensor([5.0])},
    )
    out = fixed_denominator_mean(prev, mean, ["w"], replies=2, expected=4)  # w + (2/4)(3 − 1)
    assert torch.equal(out["w"], torch.tensor([2.0])) and torch.equal(out["b"], mean["b"])
    assert fixed_denominator_mean(prev, mean, ["w"], replies=4, expected=4)["w"] is mean["w"]


def test_update_noise_multiplier_keeps_the_round_at_sigma():
    sigma, sigma_b = 1.0, 0.8
    sigma_delta = update_noise_multiplier(sigma, sigma_b)
    assert math.isclose(sigma_delta**-2 + (2 * sigma_b) ** -2, sigma**-2)
    assert update_noise_multiplier(sigma, None) == sigma and update_noise_multiplier(0.0, 0.1) == 0.0
    with pytest.raises(ValueError, match="clip_count_stddev"):
        update_noise_multiplier(1.0, 0.5)


def reference_adaptive_clipping(norms, c0, gamma, lr, m, count_noise):
    """Andrew et al. (2021), Alg. 1 with centred bits, in NumPy: the C of every round."""
    c, out = c0, []
    for t, round_norms in enumerate(norms):
        out.append(c)
        b = (np.asarray(round_norms) <= c).astype(np.float64)
        b_bar = np.clip((np.sum(b - 0.5) + count_noise[t]) / m + 0.5, 0.0, 1.0)  # TF Privacy clips b̄
        c = c * np.exp(-lr * (b_bar - gamma))
    return out + [c]


def test_the_noised_fraction_stays_a_fraction():
    """Failed before: with σ_b large against m, b̄ left [0, 1] (10 of 30 rounds in the audit's run)."""
    fractions = [noised_unclipped_fraction(b, 4, 4, 10.0, seed) for seed in range(50) for b in (0, 4)]
    assert min(fractions) == 0.0 and max(fractions) == 1.0  # the clamp was needed and held
    assert all(0.0 <= f <= 1.0 for f in fractions)


def test_adaptive_clipping_follows_the_reference_for_a_few_rounds():
    rng = np.random.default_rng(0)
    norms = rng.lognormal(0.0, 1.0, size=(8, 5))
    m, sigma_b, gamma, lr, c = 5, 0.5, 0.3, 0.2, 0.1
    noises = [
        float(torch.randn((), generator=torch.Generator().manual_seed(noise_seed(0, t, "server", "count")),
                          dtype=torch.float64)) * sigma_b
        for t in range(len(norms))
    ]  # fmt: skip
    want = reference_adaptive_clipping(norms, c, gamma, lr, m, noises)
    got = [c]
    for t, round_norms in enumerate(norms):
        bits = sum(int(n <= c) for n in round_norms)
        c = geometric_clip_update(
            c, noised_unclipped_fraction(bits, m, m, sigma_b, noise_seed(0, t, "server", "count")), gamma, lr
        )
        got.append(c)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[-1] > 1.4 * got[0]  # C = 0.1 is below every norm: it grows towards their 30 % quantile (≈ 0.6)


def test_epsilon_is_opacus_rdp_over_the_same_history():
    history = add_round(add_round(add_round([], 1.1, 0.5), 1.1, 0.5), 2.0, 0.25)
    assert history == [(1.1, 0.5, 2), (2.0, 0.25, 1)]
    accountant = RDPAccountant()
    for sigma, q in ((1.1, 0.5), (1.1, 0.5), (2.0, 0.25)):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    assert epsilon(history, 1e-3) == accountant.get_epsilon(1e-3)
    assert epsilon([], 1e-3) == 0.0 and epsilon([(0.0, 1.0, 1)], 1e-3) == math.inf


@pytest.mark.parametrize(("target", "q", "rounds"), [(2.0, 1.0, 10), (8.0, 0.4, 30), (0.5, 0.1, 100)])
def test_calibration_lands_within_one_percent_below_the_target(target, q, rounds):
    sigma = calibrate_noise_multiplier(target, 1e-3, q, rounds)
    eps = epsilon([(sigma, q, rounds)], 1e-3)
    assert 0.99 * target <= eps <= target
