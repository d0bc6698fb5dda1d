"""When an (ε, δ) guarantee stops meaning anything, and Opacus' warning that says so in other words.

ε bounds how much more likely any outcome becomes when one example (DP-SGD) or one client (DP-FedAvg) takes part:
by a factor e^ε. At ε = 1 that is 2.7×, at ε = 10 already 22,000×; beyond it the bound allows an attacker almost
any certainty, so a run there is differentially private in name only (the threshold the docs use, after
Ponomareva et al. 2023, "How to DP-fy ML", who call ε ≤ 10 the range of "reasonable" guarantees).

Opacus' RDP accountant picks the Rényi order α that gives the smallest ε among its orders (1.1 … 63 and more); when
the smallest order wins it warns "Optimal order is the smallest alpha. Please consider expanding the range of
alphas to get a tighter privacy bound." That happens when so little noise is added that ε is huge (hundreds or
thousands): a tighter order could lower the number a little but not into a meaningful range. The accountant calls
here record that warning and leave it to :func:`large_epsilon_message`, which says what it means and what to do.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

LARGE_EPSILON = 10.0
_SMALLEST_ALPHA = r"Optimal order is the smallest alpha"


def is_large(eps: float | None) -> bool:
    """Whether ``eps`` is finite and above :data:`LARGE_EPSILON` (∞, no noise at all, is reported as such)."""
    return eps is not None and math.isfinite(eps) and eps > LARGE_EPSILON


def large_epsilon_message(eps: float, delta: float | None, what: str, page: str) -> str:
    """One line: ``what`` reaches ε = ``eps``, why that guarantees next to nothing, what to change, where to read."""
    at = f" (δ = {delta:.3g})" if delta is not None else ""
    return (
        f"{what} reaches ε = {eps:.4g}{at}, above {LARGE_EPSILON:g}: such a bound lets one participant change the "
        "odds of any outcome by a factor e^ε, which protects next to nothing (Opacus' 'optimal order is the smallest "
        "alpha' says the same). Add noise (noise_multiplier / a target_epsilon of at most 10) or train fewer rounds "
        f"or steps; docs: {page}"
    )


def warn_if_large(eps: float, delta: float | None, what: str, page: str, max_epsilon: float | None) -> bool:
    """Warn with :func:`large_epsilon_message` when ``eps`` is large and no ``max_epsilon`` ≤ 10 stops the run first.

    Returns:
        Whether it warned.
    """
    if not is_large(eps) or (max_epsilon is not None and max_epsilon <= LARGE_EPSILON):
        return False
    warnings.warn(large_epsilon_message(eps, delta, what, page), stacklevel=3)
    return True


@contextmanager
def smallest_alpha_recorded() -> Iterator[None]:
    """Run an Opacus accountant call with its smallest-order warning kept out of the output (explained instead)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SMALLEST_ALPHA)
        yield
