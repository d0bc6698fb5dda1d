"""Client-level differential privacy (DP-FedAvg, McMahan et al. 2018; adaptive clipping, Andrew et al. 2021).

Round t, sampled clients S (|S| = m expected, q = m/N), global state w:

- client i: Δ_i = w_i − w, clipped Δ̃_i = Δ_i · min(1, C/‖Δ_i‖₂) (one L2 norm over all clipped tensors);
- server: w ← w + (Σ_{i∈S} Δ̃_i + N(0, σ_Δ² C² I)) / m (fixed denominator m: the sum's sensitivity is C);
- adaptive clipping: b_i = 1[‖Δ_i‖ ≤ C]; b̄ = (Σ_i (b_i − ½) + N(0, σ_b²)) / m + ½ (centred bits: sensitivity ½);
  C ← C · exp(−η_C (b̄ − γ)); the update's noise multiplier σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2), so that the two
  Gaussian queries of the round compose to one of noise multiplier σ;
- accounting: RDP of the sampled Gaussian mechanism (q, σ) composed over the rounds, converted to (ε, δ).

The noise is drawn from ``torch.Generator`` objects seeded by (seed, round, who): the same on every transport and
after a resume.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fl_lightning.ops import dp_sgd

History = list[tuple[float, float, int]]  # Opacus' accountant history: (noise multiplier, sample rate, steps)


def noise_seed(seed: int, round_idx: int, who: str, stream: str) -> int:
    """A 63-bit generator seed from (run seed, round, ``client id`` or ``server``, stream name)."""
    digest = hashlib.sha256(f"dp_fedavg|{seed}|{round_idx}|{who}|{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def gaussian_noise(like: Mapping[str, Tensor], std: float, seed: int) -> dict[str, Tensor]:
    """N(0, std² I) per tensor of ``like`` (its shapes, dtypes and devices), keys drawn in ``like``'s order.

    Drawn on the CPU from one generator so the values do not depend on the device.
    """
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g, dtype=v.dtype) * std).to(v.device) for k, v in like.items()}


def global_norm(tensors: Mapping[str, Tensor]) -> float:
    """‖Δ‖₂ over all tensors together (accumulated in float64)."""
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors.values()))


def clip_factor(norm: float, clip_norm: float | None) -> float:
    """min(1, C/‖Δ‖) (1 when C is None/∞ or Δ = 0)."""
    if clip_norm is None or math.isinf(clip_norm) or norm <= clip_norm:
        return 1.0
    return clip_norm / norm


def clip_update(delta: Mapping[str, Tensor], clip_norm: float | None) -> tuple[dict[str, Tensor], float]:
    """Δ̃ = Δ · min(1, C/‖Δ‖₂) and ‖Δ‖₂ (the unclipped norm)."""
    norm = global_norm(delta)
    factor = clip_factor(norm, clip_norm)
    return ({k: v * factor for k, v in delta.items()} if factor < 1 else dict(delta)), norm


def private_state(
    local: Mapping[str, Tensor],
    received: Mapping[str, Tensor],
    keys: Sequence[str],
    clip_norm: float | None,
    noise_std: float = 0.0,
    seed: int = 0,
) -> tuple[dict[str, Tensor], float]:
    """The state a client sends, and ‖Δ‖₂: w + Δ̃ (+ N(0, noise_std² I), distributed noise) on ``keys``.

    Every other entry (buffers, frozen parameters) is sent back as received, so nothing else that travels depends
    on the client's data. An update inside the ball with no noise to add is sent as trained (no w + (w_i − w)
    rounding), so that C = ∞, σ = 0 sends exactly FedAvg's state.
    """
    delta = {k: local[k] - received[k] for k in keys}
    norm = global_norm(delta)
    factor = clip_factor(norm, clip_norm)
    out = {**received, **{k: local[k] for k in keys}}
    if factor == 1.0 and noise_std == 0:
        return out, norm
    noise = gaussian_noise(delta, noise_std, seed) if noise_std > 0 else {}
    for k in keys:
        d = delta[k] * factor if factor < 1 else delta[k]
        out[k] = received[k] + (d + noise[k] if noise else d)
    return out, norm


def fixed_denominator_mean(
    previous: Mapping[str, Tensor], averaged: Mapping[str, Tensor], keys: Sequence[str], replies: int, expected: int
) -> dict[str, Tensor]:
    """The fixed-denominator step w + Σ_{i∈S'} Δ̃_i / m from the mean over the S' that replied: w + (|S'|/m)(mean − w).

    With every sampled client replying (|S'| = m) the mean is returned unchanged.
    """
    if replies == expected:
        return dict(averaged)
    scale = replies / expected
    return {**averaged, **{k: previous[k] + (averaged[k] - previous[k]) * scale for k in keys}}


def update_noise_multiplier(noise_multiplier: float, count_stddev: float | None) -> float:
    """The update's noise multiplier σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) (Andrew et al. 2021, §3.1).

    σ_Δ = σ without adaptive clipping (``count_stddev`` None), and 0 for σ = 0.

    Raises:
        ValueError: If 2σ_b ≤ σ (the count alone would spend the round's budget).

    """
    if count_stddev is None or noise_multiplier == 0:
        return noise_multiplier
    if not 2 * count_stddev > noise_multiplier:
        raise ValueError(
            f"clip_count_stddev={count_stddev} must exceed noise_multiplier/2={noise_multiplier / 2}: "
            "raise clip_count_stddev (Andrew et al. suggest m/20) or lower the noise multiplier"
        )
    return (noise_multiplier**-2 - (2 * count_stddev) ** -2) ** -0.5


def noised_unclipped_fraction(bits: int, replies: int, expected: int, count_stddev: float, seed: int) -> float:
    """b̄ = (Σ_i (b_i − ½) + N(0, σ_b²)) / m + ½ over the ``replies`` bits whose sum is ``bits``, clamped to [0, 1].

    The clamp is the authors' (TF Privacy's quantile estimator clips the noised fraction to [0, 1]): with a small
    σ_b relative to m the noise alone can push b̄ outside the range a fraction has, and the geometric step would
    then move C further than any real fraction of updates could.
    """
    g = torch.Generator().manual_seed(seed)
    noise = float(torch.randn((), generator=g, dtype=torch.float64)) * count_stddev
    return min(1.0, max(0.0, (bits - replies / 2 + noise) / expected + 0.5))


def geometric_clip_update(clip_norm: float, fraction: float, target_quantile: float, lr: float) -> float:
    """C ← C · exp(−η_C (b̄ − γ)): C shrinks while more than a fraction γ of updates fall inside it."""
    return clip_norm * math.exp(-lr * (fraction - target_quantile))


def epsilon(history: History, delta: float) -> float:
    """ε at ``delta`` of the composed sampled Gaussian mechanisms in ``history`` (∞ with a σ = 0 round).

    Opacus' RDP accountant, not dp-accounting: DP-SGD depends on Opacus already, so both guarantees come from one
    accountant (same RDP orders, same conversion to (ε, δ)) and one dependency.
    """
    return dp_sgd.epsilon(history, delta, "rdp")


def add_round(history: History, noise_multiplier: float, sample_rate: float) -> History:
    """``history`` plus one round, merging it into the last entry when (σ, q) repeat (as Opacus' ``step``)."""
    return dp_sgd.add_steps(history, noise_multiplier, sample_rate, 1)


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, rounds: int) -> float:
    """The σ whose ε after ``rounds`` rounds at rate q lies in [0.995 ε_target, ε_target] (Opacus' bisection)."""
    # Opacus' tolerance is absolute: 0.5 % of the target
    return dp_sgd.calibrate_noise(target_epsilon, delta, sample_rate, rounds, "rdp", 0.005 * target_epsilon)
