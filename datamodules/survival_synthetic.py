"""Generated multi-site survival data: a shared Cox model, per-site covariate shift and baseline hazard, censoring.

Every site draws its patients from the same proportional-hazards model (one coefficient vector β for all) but
with its own covariate means and its own baseline hazard, the two ways hospitals differ most. Nothing is read
from disk; the data depend only on the arguments and the seed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from datamodules.base import ClientSplit, FederatedDataModule
from datamodules.sampler import stable_seed
from datamodules.split import split_train_test
from datamodules.table_rows import standardisation
from datamodules.validation import with_validation

_STD_EPS = 1e-9  # added to each feature's std, so a constant column divides by it (the clinical tables' choice)


def event_times(risk: np.ndarray, baseline_hazard: float, shape: float, rng: np.random.Generator) -> np.ndarray:
    """Weibull proportional-hazards event times: hazard h(t | x) = λ k t^(k−1) exp(r).

    Inverting the survival function S(t) = exp(−λ t^k e^r) at a uniform draw gives
    T = (E / (λ e^r))^(1/k) with E ~ Exp(1); k = 1 is the exponential model.

    Args:
        risk: Log relative hazards r = x·β, (N,).
        baseline_hazard: The site's baseline hazard scale λ > 0.
        shape: Weibull shape k > 0.
        rng: The site's generator.

    Returns:
        Event times, (N,), positive.
    """
    return (rng.exponential(size=len(risk)) / (baseline_hazard * np.exp(risk))) ** (1.0 / shape)


def censoring_rate(times: np.ndarray, fraction: float, iterations: int = 200) -> float:
    """The rate c of exponential censoring C ~ Exp(c) that censors a ``fraction`` of ``times`` in expectation.

    A sample with event time T is censored when C < T, with probability 1 − exp(−c T); the mean of that over
    ``times`` increases from 0 (c = 0) to 1 (c → ∞), so bisection on log c finds the rate.

    Args:
        times: Event times, (N,), positive.
        fraction: Target expected censored fraction, in [0, 1).
        iterations: Bisection steps (200 reach float precision from any bracket used here).

    Returns:
        The rate c (0 for ``fraction`` = 0: nothing is censored).
    """
    if fraction <= 0:
        return 0.0
    # Bracket log c around the rate of a typical time; the mean is monotone in c, so bisection cannot miss.
    scale = float(np.log(1.0 / np.median(times)))
    low, high = scale - 50.0, scale + 50.0
    for _ in range(iterations):
        mid = 0.5 * (low + high)
        if np.mean(1.0 - np.exp(-np.exp(mid) * times)) < fraction:
            low = mid
        else:
            high = mid
    return float(np.exp(0.5 * (low + high)))


def simulate_site(
    n: int, beta: np.ndarray, offset: np.ndarray, baseline_hazard: float, shape: float, censoring: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """One site's raw patients: covariates x ~ N(offset, I), Weibull event times with risk x·β, censoring.

    Returns:
        ``(x (n, F), time (n,), event (n,))``: the observed time min(T, C) and 1 where T ≤ C (the event was seen).
    """
    x = offset + rng.normal(size=(n, len(beta)))
    t_event = event_times(x @ beta, baseline_hazard, shape, rng)
    rate = censoring_rate(t_event, censoring)
    t_censor = rng.exponential(1.0 / rate, size=n) if rate > 0 else np.full(n, np.inf)
    return x, np.minimum(t_event, t_censor), (t_event <= t_censor).astype(np.float64)


class SyntheticSurvivalFederated(FederatedDataModule):
    """Generated, seeded survival data on several sites sharing one Cox model (``label_kind = "survival"``).

    Coefficients β (F,) are drawn once per seed, N(0, 1) rescaled to norm ``effect``. Site s draws its covariates
    from N(μ_s, I), with a site mean μ_s ~ N(0, ``covariate_shift``² I), its baseline hazard scale
    λ_s = exp(N(0, ``hazard_spread``²)), event times from the Weibull proportional-hazards model with risk x·β
    and shape ``weibull_shape`` (1: exponential), and independent exponential censoring whose rate is set per
    site so that a ``censoring`` fraction is censored in expectation. Each site's test set is a seeded
    ``test_fraction`` stratified by event; ``val_fraction`` carves a validation set out of its training rows
    (stratified by event too). Features are then standardised with each site's training rows' mean and std, as
    a hospital would before training; the labels are float32 ``(time, event)`` pairs.

    Args:
        num_clients: Sites (clients ``"site0"``, ``"site1"``, ...).
        samples_per_client: Patients per site: one number for all, or one per site.
        num_features: Covariates F.
        effect: Norm of the true coefficient vector ‖β‖ (0: the covariates carry no information).
        covariate_shift: Standard deviation of the per-site covariate means (0: every site alike).
        hazard_spread: Standard deviation of the per-site log baseline hazard (0: one baseline for all).
        weibull_shape: Shape k of the Weibull event times (1: exponential; > 1 rising hazard).
        censoring: Expected fraction of censored patients per site, in [0, 1).
        test_fraction: Fraction of each site's patients held out as its test set.
        val_fraction: Fraction of each site's training patients held out as its validation set.
        seed: Seed of β, the sites, the splits and shuffling.
        batch_size: Training batch size (a Cox batch's risk sets are its own samples: not too small).
        eval_batch_size: Batch size of the evaluation loaders (metrics are computed over the whole set anyway).

    Raises:
        ValueError: On an invalid argument, naming it and its valid range.
    """

    sample_kind = "table"
    label_kind = "survival"

    def __init__(
        self,
        num_clients: int = 4,
        samples_per_client: int | list[int] = 200,
        num_features: int = 8,
        effect: float = 1.5,
        covariate_shift: float = 0.5,
        hazard_spread: float = 0.5,
        weibull_shape: float = 1.0,
        censoring: float = 0.3,
        test_fraction: float = 0.2,
        val_fraction: float = 0.0,
        seed: int = 0,
        batch_size: int = 64,
        eval_batch_size: int = 256,
    ) -> None:
        super().__init__(
            batch_size=batch_size, eval_batch_size=eval_batch_size, test_fraction=test_fraction, seed=seed,
            val_fraction=val_fraction,
        )  # fmt: skip
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        sizes = [samples_per_client] * num_clients if isinstance(samples_per_client, int) else list(samples_per_client)
        if len(sizes) != num_clients:
            raise ValueError(
                f"samples_per_client lists {len(sizes)} sizes for num_clients={num_clients}: give one per site, "
                "or one number for all"
            )
        if any(n < 2 for n in sizes):
            raise ValueError(
                f"samples_per_client must be >= 2 for every site (a training and a test patient), got {sizes}"
            )
        if num_features < 1:
            raise ValueError(f"num_features must be >= 1, got {num_features}")
        for name, value in (("effect", effect), ("covariate_shift", covariate_shift), ("hazard_spread", hazard_spread)):
            if not value >= 0:  # also refuses NaN
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not weibull_shape > 0:
            raise ValueError(f"weibull_shape must be > 0, got {weibull_shape}")
        if not 0.0 <= censoring < 1.0:
            raise ValueError(f"censoring must be in [0, 1) (the expected censored fraction), got {censoring}")
        self.sizes = sizes
        self.num_sites, self.feature_count = num_clients, num_features
        self.effect, self.covariate_shift, self.hazard_spread = effect, covariate_shift, hazard_spread
        self.weibull_shape, self.censoring = weibull_shape, censoring

    @property
    def coefficients(self) -> np.ndarray:
        """The true coefficients β (F,) of the raw (unstandardised) covariates, the same on every site."""
        beta = np.random.default_rng(stable_seed(self.seed, "survival", "beta")).normal(size=self.feature_count)
        return beta * (self.effect / max(float(np.linalg.norm(beta)), 1e-12))

    def label_names(self) -> list[str]:
        """What :meth:`label_counts` counts of survival labels: censored (0) and event (1) samples."""
        return ["censored", "event"]

    def _load(self) -> list[ClientSplit]:
        beta = self.coefficients
        splits = []
        for s, n in enumerate(self.sizes):
            cid = f"site{s}"
            rng = np.random.default_rng(stable_seed(self.seed, "survival", cid))
            offset = rng.normal(scale=self.covariate_shift, size=self.feature_count)
            baseline = float(np.exp(rng.normal(scale=self.hazard_spread)))
            x, time, event = simulate_site(n, beta, offset, baseline, self.weibull_shape, self.censoring, rng)
            train, test = split_train_test(np.arange(n), event.astype(np.int64), self.test_fraction,
                                           stable_seed(self.seed, "test", cid))  # fmt: skip
            features = torch.from_numpy(x).float()
            labels = torch.from_numpy(np.stack([time, event], axis=1)).float()
            split = ClientSplit(cid, features[train], labels[train], features[test], labels[test])
            splits.append(self._standardised(with_validation(split, self.val_fraction, self.seed, self._source)))
        return splits

    @staticmethod
    def _standardised(split: ClientSplit) -> ClientSplit:
        """The split's features standardised with its training rows' mean and std (validation carved first)."""
        mean, std = standardisation(split.train_x, _STD_EPS)
        scale = lambda x: (x - mean) / std  # noqa: E731
        return dataclasses.replace(
            split, train_x=scale(split.train_x), test_x=scale(split.test_x), val_x=scale(split.val_x)
        )
