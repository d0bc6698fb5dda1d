"""Sample-level differential privacy (DP-SGD): accounting, calibration and Poisson batches, through Opacus.

Each DP-SGD step clips every example's gradient to L2 norm ≤ C, sums them, adds N(0, σ²C²) per coordinate and
divides by the expected batch size B = q·n (Abadi et al., 2016). With batches drawn by Poisson sampling (each
example independently with probability q), T such steps are the sampled Gaussian mechanism composed T times; its
(ε, δ) comes from an Opacus accountant (RDP by default, PRV or GDP) over the step history: a list of
``(σ, q, steps)`` entries, plain data that a checkpoint holds and that replays to the same ε.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from fl_lightning.models.layer_kinds import BATCH_NORMS
from fl_lightning.ops.dp_meaning import smallest_alpha_recorded

# Opacus is imported where it is used: it costs ~0.25 s, which every process importing ``callbacks`` (train.py
# --help, each rank) would pay for a method few runs use.

ACCOUNTANTS = ("rdp", "prv", "gdp")

# A step history: (noise multiplier σ, sample rate q, number of steps) entries, in order.
History = list[tuple[float, float, int]]


def add_steps(history: Sequence[Sequence[float]], noise_multiplier: float, sample_rate: float, steps: int) -> History:
    """The history with ``steps`` more steps of (σ, q), merged into the last entry when it has the same (σ, q).

    The merge is what Opacus' accountants do step by step, so a history built fit by fit equals theirs.
    """
    out: History = [(float(s), float(q), int(n)) for s, q, n in history]
    if steps <= 0:
        return out
    if out and out[-1][0] == noise_multiplier and out[-1][1] == sample_rate:
        out[-1] = (out[-1][0], out[-1][1], out[-1][2] + int(steps))
    else:
        out.append((float(noise_multiplier), float(sample_rate), int(steps)))
    return out


def epsilon(history: Sequence[Sequence[float]], delta: float, accountant: str = "rdp") -> float:
    """ε of the composed sampled Gaussian mechanism given by ``history`` at ``delta``, by an Opacus accountant.

    Args:
        history: ``(σ, q, steps)`` entries.
        delta: δ of the (ε, δ) guarantee.
        accountant: ``rdp``, ``prv`` or ``gdp`` (Opacus' names).

    Returns:
        0 for an empty history, ``inf`` when a step ran without noise (σ = 0), else the accountant's ε.

    """
    entries = [(float(s), float(q), int(n)) for s, q, n in history if int(n) > 0]
    if not entries:
        return 0.0
    if any(s == 0 for s, _, _ in entries):
        return math.inf  # no noise: no finite guarantee (the accountants would divide by zero)
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    acc.history = entries
    with smallest_alpha_recorded():  # a huge ε: explained by the callers' large-ε warning (ops/dp_meaning.py)
        return float(acc.get_epsilon(delta=delta))


@lru_cache(maxsize=256)  # a bisection over σ (~1 s); clients of equal size share it
def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
    epsilon_tolerance: float | None = None,
) -> float:
    """The smallest σ (to ``epsilon_tolerance``, else Opacus' default) keeping ``steps`` steps at rate q within ε."""
    from opacus.accountants.utils import get_noise_multiplier

    tolerance = {} if epsilon_tolerance is None else {"epsilon_tolerance": epsilon_tolerance}
    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
            **tolerance,
        )
    )


def batch_norm_layers(module: nn.Module) -> list[str]:
    """Names of the BatchNorm layers of ``module``: their statistics mix examples, so DP-SGD cannot use them."""
    return [name for name, m in module.named_modules() if isinstance(m, BATCH_NORMS)]


def poisson_loader(
    dataset: Dataset,
    sample_rate: float,
    steps: int,
    generator: torch.Generator,
    collate_fn: Callable[[Any], Any] = default_collate,
) -> DataLoader:
    """A loader of ``steps`` batches per pass, each holding every example independently with probability q.

    Opacus' :class:`UniformWithReplacementSampler` draws the batches (and its collate function turns an empty
    draw into a zero-length batch), from ``generator`` only: the batches depend on its seed and nothing else.
    ``collate_fn`` is the client loader's own (a dataset read one batch at a time brings its own).

    The loader's iterators draw their base seed (unused: no worker processes) from a generator of the loader's own,
    never from torch's global one: Lightning creates a different number of iterators on a Trainer's first fit than
    on later ones, so a resumed process would otherwise be a draw behind and every dropout mask after it would
    differ from the uninterrupted run's.
    """
    from opacus.data_loader import wrap_collate_with_empty
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    sampler = UniformWithReplacementSampler(
        num_samples=len(dataset), sample_rate=sample_rate, generator=generator, steps=steps
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=0,
        collate_fn=wrap_collate_with_empty(collate_fn=collate_fn),
        generator=torch.Generator().manual_seed(0),
    )
