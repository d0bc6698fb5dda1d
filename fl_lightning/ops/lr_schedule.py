"""Per-round learning-rate schedules: the factor that multiplies the local learning rate in round r."""

from __future__ import annotations

import math
from typing import Literal

ScheduleKind = Literal["constant", "exponential", "step", "cosine", "poly"]
SCHEDULE_KINDS: tuple[str, ...] = ("constant", "exponential", "step", "cosine", "poly")


def check_schedule_args(kind: str, gamma: float, step_size: int, power: float, min_factor: float) -> None:
    """Validate the settings of a schedule (all of them, whatever the kind, so a typo fails early).

    Raises:
        ValueError: Naming the first bad argument and its value.

    """
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(SCHEDULE_KINDS)}, got {kind!r}")
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1] (a decay per round or per step), got {gamma}")
    if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
        raise ValueError(f"step_size must be an integer >= 1, got {step_size!r}")
    if not power > 0:
        raise ValueError(f"power must be > 0, got {power}")
    if not 0 <= min_factor <= 1:
        raise ValueError(f"min_factor must be in [0, 1], got {min_factor}")


def lr_factor(
    kind: ScheduleKind,
    round_idx: int,
    total_rounds: int,
    gamma: float = 0.97,
    step_size: int = 10,
    power: float = 0.9,
    min_factor: float = 0.0,
) -> float:
    """The factor of the base learning rate in round ``round_idx`` (0-based) of ``total_rounds``.

    With r = ``round_idx`` and R = ``total_rounds``:

    - ``constant``: 1
    - ``exponential``: γ^r
    - ``step``: γ^⌊r / step_size⌋
    - ``cosine``: m + (1 − m)(1 + cos(π r / R)) / 2 with m = ``min_factor``
    - ``poly``: (1 − r / R)^power

    Every kind is floored at ``min_factor`` (``cosine`` approaches it by construction), so the
    factor is 1 in round 0 and never below ``min_factor``. The factor depends on the round index
    only: a run that splits its model (CFL, DDI) or resumes from a checkpoint continues the decay.

    Args:
        kind: The schedule.
        round_idx: 0-based index of the running round, 0 ≤ r < R.
        total_rounds: Number of rounds of the run, R ≥ 1 (``cosine`` and ``poly`` reach their end at R).
        gamma: Decay γ ∈ (0, 1] of ``exponential`` (per round) and ``step`` (per step).
        step_size: Rounds per step of ``step``.
        power: Exponent of ``poly``, > 0.
        min_factor: Lower bound of the factor, in [0, 1].

    Returns:
        The factor, in [min_factor, 1].

    Raises:
        ValueError: On a bad argument, naming it.

    """
    check_schedule_args(kind, gamma, step_size, power, min_factor)
    if isinstance(total_rounds, bool) or not isinstance(total_rounds, int) or total_rounds < 1:
        raise ValueError(f"total_rounds must be an integer >= 1, got {total_rounds!r}")
    if isinstance(round_idx, bool) or not isinstance(round_idx, int) or not 0 <= round_idx < total_rounds:
        raise ValueError(f"round_idx must be an integer in [0, total_rounds={total_rounds}), got {round_idx!r}")
    r, big_r = round_idx, total_rounds
    if kind == "constant":
        factor = 1.0
    elif kind == "exponential":
        factor = gamma**r
    elif kind == "step":
        factor = gamma ** (r // step_size)
    elif kind == "cosine":
        factor = min_factor + (1 - min_factor) * (1 + math.cos(math.pi * r / big_r)) / 2
    else:  # poly
        factor = (1 - r / big_r) ** power
    return max(float(factor), min_factor)
