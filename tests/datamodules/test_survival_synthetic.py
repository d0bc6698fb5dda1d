"""Generated survival sites: shapes, seeding, censoring, the Weibull model, standardisation, splits and errors."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from datamodules.survival_synthetic import SyntheticSurvivalFederated, censoring_rate, event_times


def _all_labels(data: SyntheticSurvivalFederated) -> torch.Tensor:
    return torch.cat([torch.cat([s.train_y, s.val_y, s.test_y]) for s in map(data.client_data, data.client_ids)])


def test_shapes_dtypes_ids_and_counts():
    data = SyntheticSurvivalFederated(num_clients=3, samples_per_client=[50, 80, 120], num_features=5, seed=1)
    assert data.client_ids == ["site0", "site1", "site2"]
    assert data.num_features == 5 and data.num_classes == 2 and data.sample_kind == "table"
    for cid, n in zip(data.client_ids, [50, 80, 120]):
        s = data.client_data(cid)
        assert s.train_x.dtype == s.test_x.dtype == s.train_y.dtype == torch.float32
        assert s.train_x.shape[1] == 5 and s.train_y.shape[1] == 2 and s.test_y.shape == (len(s.test_x), 2)
        assert len(s.train_y) + len(s.test_y) == n and len(s.test_y) == round(0.2 * n)
        assert bool((s.train_y[:, 0] > 0).all()) and set(s.train_y[:, 1].tolist()) <= {0.0, 1.0}
        counts = data.label_counts(cid)
        assert counts.tolist() == [int((s.train_y[:, 1] == 0).sum()), int((s.train_y[:, 1] == 1).sum())]
    x, y = next(iter(data.client_train_loader("site0")))
    assert x.shape == (min(data.batch_size, 40), 5) and y.shape == (len(x), 2)


def test_same_seed_same_data_other_seed_other_data():
    one, same, other = (SyntheticSurvivalFederated(seed=s) for s in (4, 4, 5))
    for cid in one.client_ids:
        a, b, c = one.client_data(cid), same.client_data(cid), other.client_data(cid)
        assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
        assert not torch.equal(a.train_y, c.train_y)
    assert np.array_equal(one.coefficients, same.coefficients)
    assert not np.allclose(one.coefficients, other.coefficients)
    assert np.linalg.norm(one.coefficients) == pytest.approx(one.effect)


@pytest.mark.parametrize("target", [0.0, 0.15, 0.5, 0.8])
def test_censored_fraction_is_near_the_target(target):
    data = SyntheticSurvivalFederated(num_clients=4, samples_per_client=500, censoring=target, seed=2)
    censored = float((_all_labels(data)[:, 1] == 0).double().mean())
    assert censored == pytest.approx(target, abs=0.04)  # 2000 patients: a binomial sd of at most 0.011


def test_censoring_rate_hits_the_expected_fraction():
    times = np.random.default_rng(0).weibull(1.5, size=300) * 3.0
    for fraction in (0.05, 0.3, 0.9):
        rate = censoring_rate(times, fraction)
        assert np.mean(1.0 - np.exp(-rate * times)) == pytest.approx(fraction, abs=1e-9)
    assert censoring_rate(times, 0.0) == 0.0


@pytest.mark.parametrize(("shape", "hazard", "risk"), [(1.0, 1.0, 0.0), (2.0, 0.5, 0.7), (0.7, 3.0, -0.4)])
def test_event_times_follow_the_weibull_survival_function(shape, hazard, risk):
    times = event_times(np.full(40_000, risk), hazard, shape, np.random.default_rng(0))
    for t in np.quantile(times, [0.1, 0.5, 0.9]):
        survival = np.exp(-hazard * t**shape * np.exp(risk))  # S(t) = exp(−λ t^k e^r)
        assert np.mean(times > t) == pytest.approx(survival, abs=0.01)


def test_features_are_standardised_with_each_sites_training_rows():
    data = SyntheticSurvivalFederated(num_clients=2, samples_per_client=100, val_fraction=0.2, covariate_shift=3.0)
    for cid in data.client_ids:
        s = data.client_data(cid)
        assert len(s.val_y) == round(0.2 * 80) and len(s.train_y) == 64
        torch.testing.assert_close(s.train_x.mean(0), torch.zeros(8), atol=1e-5, rtol=0)
        torch.testing.assert_close(s.train_x.std(0), torch.ones(8), atol=1e-5, rtol=0)
        assert s.val_x.mean(0).abs().max() > 1e-3  # the validation rows were not part of the statistics


def test_sites_differ_in_baseline_hazard():
    shifted = SyntheticSurvivalFederated(samples_per_client=400, hazard_spread=1.5, seed=0, censoring=0.0)
    alike = SyntheticSurvivalFederated(samples_per_client=400, hazard_spread=0.0, covariate_shift=0.0, seed=0,
                                       censoring=0.0)  # fmt: skip

    def log_median_spread(data: SyntheticSurvivalFederated) -> float:
        medians = [float(data.client_data(c).train_y[:, 0].median()) for c in data.client_ids]
        return float(np.std(np.log(medians)))

    assert log_median_spread(shifted) > 3 * log_median_spread(alike)


def test_the_test_split_is_stratified_by_event():
    data = SyntheticSurvivalFederated(num_clients=3, samples_per_client=101, test_fraction=0.3, censoring=0.4, seed=6)
    for cid in data.client_ids:
        s = data.client_data(cid)
        events = int(s.train_y[:, 1].sum() + s.test_y[:, 1].sum())
        assert abs(int(s.test_y[:, 1].sum()) - 0.3 * events) <= 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_clients": 0}, "num_clients must be >= 1, got 0"),
        ({"samples_per_client": [10, 10]}, "samples_per_client lists 2 sizes for num_clients=4"),
        ({"samples_per_client": 1}, "samples_per_client must be >= 2"),
        ({"num_features": 0}, "num_features must be >= 1, got 0"),
        ({"effect": -1.0}, "effect must be >= 0, got -1.0"),
        ({"covariate_shift": float("nan")}, "covariate_shift must be >= 0, got nan"),
        ({"hazard_spread": -0.1}, "hazard_spread must be >= 0, got -0.1"),
        ({"weibull_shape": 0.0}, "weibull_shape must be > 0, got 0.0"),
        ({"censoring": 1.0}, "censoring must be in [0, 1)"),
        ({"test_fraction": 1.0}, "test_fraction must be in [0, 1), got 1.0"),
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        SyntheticSurvivalFederated(**kwargs)
