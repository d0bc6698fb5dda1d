"""The Cox partial likelihood and Harrell's C-index against lifelines and a plain double loop."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from lifelines import CoxPHFitter
from lifelines.utils import concordance_index as lifelines_cindex

from fl_lightning.ops import survival
from fl_lightning.ops.survival import concordance_counts, concordance_index, cox_partial_likelihood

SEEDS = [0, 1, 2, 3]


def survival_data(seed: int, n: int = 120, features: int = 3, tied_times: bool = False, censored: float = 0.3):
    """Exponential times with risk x·β, uniform censoring; integer times (many ties) with ``tied_times``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features))
    beta = rng.normal(size=features)
    t_event = rng.exponential(np.exp(-x @ beta))
    t_censor = rng.uniform(0, np.quantile(t_event, 1 - censored) * 2, size=n)
    time = np.minimum(t_event, t_censor)
    event = (t_event <= t_censor).astype(np.float64)
    if tied_times:
        time = np.ceil(time * 4)  # a handful of distinct times
    return x, time, event


def breslow_loop(risk: np.ndarray, time: np.ndarray, event: np.ndarray) -> float:
    """The Breslow negative partial log-likelihood per event, one event and one risk-set member at a time."""
    total, events = 0.0, 0
    for j in range(len(risk)):
        if event[j]:
            risk_set = sum(math.exp(risk[k]) for k in range(len(risk)) if time[k] >= time[j])
            total += risk[j] - math.log(risk_set)
            events += 1
    return -total / events


@pytest.mark.parametrize("seed", SEEDS)
def test_cox_loss_at_lifelines_fit_is_its_log_likelihood(seed):
    x, time, event = survival_data(seed)  # continuous times: no ties, where Efron (lifelines) equals Breslow
    assert len(np.unique(time)) == len(time)
    frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(x.shape[1])]).assign(T=time, E=event)
    fitted = CoxPHFitter().fit(frame, duration_col="T", event_col="E")
    risk = torch.from_numpy(x @ fitted.params_.to_numpy())
    loss = cox_partial_likelihood(risk, torch.from_numpy(time), torch.from_numpy(event))
    assert loss.dtype == torch.float64
    assert -loss.item() * event.sum() == pytest.approx(fitted.log_likelihood_, abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tied_times", [False, True])
def test_cox_loss_equals_the_breslow_double_loop(seed, tied_times):
    x, time, event = survival_data(seed, n=60, tied_times=tied_times)
    if tied_times:
        assert len(np.unique(time)) < len(time) / 2
    risk = np.random.default_rng(seed + 100).normal(scale=2.0, size=len(time))
    got = cox_partial_likelihood(torch.from_numpy(risk), torch.from_numpy(time), torch.from_numpy(event))
    assert got.item() == pytest.approx(breslow_loop(risk, time, event), abs=1e-10)


def test_cox_loss_is_stable_for_large_risks():
    _, time, event = survival_data(0, n=50)
    risk = np.random.default_rng(0).normal(scale=1.0, size=50)
    expected = breslow_loop(risk, time, event)  # the loss is invariant to a shared shift of every risk
    shifted = cox_partial_likelihood(torch.from_numpy(risk + 1000.0), torch.from_numpy(time), torch.from_numpy(event))
    assert shifted.item() == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("tied_times", [False, True])
def test_cox_loss_gradient_passes_gradcheck(tied_times):
    _, time, event = survival_data(5, n=25, tied_times=tied_times)
    risk = torch.randn(25, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    t, e = torch.from_numpy(time), torch.from_numpy(event)
    assert torch.autograd.gradcheck(lambda r: cox_partial_likelihood(r, t, e), (risk,))


def test_all_censored_gives_a_zero_loss_that_backpropagates_zeros():
    risk = torch.randn(10, requires_grad=True)
    loss = cox_partial_likelihood(risk, torch.arange(10.0), torch.zeros(10))
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(risk.grad, torch.zeros(10))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tied_times", [False, True])
@pytest.mark.parametrize("tied_risk", [False, True])
def test_cindex_equals_lifelines(seed, tied_times, tied_risk):
    x, time, event = survival_data(seed, n=150, tied_times=tied_times)
    risk = x[:, 0] + 0.5 * np.random.default_rng(seed).normal(size=len(time))
    if tied_risk:
        risk = np.round(risk)  # a few distinct scores: many tied pairs
        assert len(np.unique(risk)) < 15
    risk_t = torch.from_numpy(risk).float()
    got = concordance_index(risk_t, torch.from_numpy(time), torch.from_numpy(event))
    assert got == pytest.approx(lifelines_cindex(time, -risk_t.numpy(), event), abs=1e-6)


def test_cindex_counts_equal_lifelines_naive_rules_with_ties_between_event_and_censoring():
    # every kind of tie: an event and a censoring at one time, two events at one time, equal risks
    time = np.array([1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0])
    event = np.array([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    risk = np.array([2.0, 2.0, 1.0, 1.0, 0.0, 0.0, 3.0])
    from lifelines.utils.concordance import _naive_concordance_summary_statistics

    want = _naive_concordance_summary_statistics(time, -risk, event)
    got = concordance_counts(torch.from_numpy(risk), torch.from_numpy(time), torch.from_numpy(event))
    assert (got.concordant, got.tied, got.comparable) == tuple(int(v) for v in want)
    assert got.comparable > 0 and got.tied > 0


def test_cindex_chunks_give_the_unchunked_counts(monkeypatch):
    x, time, event = survival_data(7, n=200, tied_times=True)
    args = (torch.from_numpy(x[:, 0]), torch.from_numpy(time), torch.from_numpy(event))
    whole = concordance_counts(*args)
    monkeypatch.setattr(survival, "_PAIRS_PER_CHUNK", 450)  # 2 rows per chunk
    assert concordance_counts(*args) == whole


def test_cindex_of_a_constant_is_one_half_and_of_the_truth_one():
    _, time, event = survival_data(3, n=80)
    t, e = torch.from_numpy(time), torch.from_numpy(event)
    assert concordance_index(torch.zeros(80), t, e) == 0.5
    assert concordance_index(-t, t, e) == 1.0  # risk decreasing in time orders every comparable pair right
    assert concordance_index(t, t, e) == 0.0


def test_cindex_without_comparable_pair_is_nan():
    counts = concordance_counts(torch.randn(6), torch.arange(6.0), torch.zeros(6))
    assert counts == (0, 0, 0)
    assert math.isnan(concordance_index(torch.randn(6), torch.arange(6.0), torch.zeros(6)))
    with pytest.raises(ZeroDivisionError):  # lifelines has no value either
        lifelines_cindex(np.arange(6.0), np.zeros(6), np.zeros(6))


@pytest.mark.parametrize("fn", [cox_partial_likelihood, concordance_index])
def test_shapes_are_checked_naming_the_argument(fn):
    with pytest.raises(ValueError, match="risk must be 1-D"):
        fn(torch.zeros(4, 1), torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="time must have the shape of risk"):
        fn(torch.zeros(4), torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="event must have the shape of risk"):
        fn(torch.zeros(4), torch.zeros(4), torch.zeros(4, 2))
