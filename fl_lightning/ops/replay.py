"""Experience replay's batch composition: a batch joined by replay samples, with per-sample loss weights."""

from __future__ import annotations

import torch
from torch import Tensor


def join_replay(
    x: Tensor, y: Tensor, x_replay: Tensor, y_replay: Tensor, replay_weight: float
) -> tuple[Tensor, Tensor, Tensor]:
    """One training batch of B samples and B' replay samples, weighted so that Σ_i w_i ℓ_i = CE(batch) + λ·CE(replay).

    Args:
        x: The batch's images (B, C, H, W).
        y: Their labels (B,).
        x_replay: Replay images (B', C, H, W).
        y_replay: Their labels (B',).
        replay_weight: λ ≥ 0.

    Returns:
        ``(images (B + B', ...), labels (B + B',), weights (B + B',))`` with the batch first; weights are 1/B for
        the batch and λ/B' for the replay samples, so a weighted sum of per-sample losses is mean + λ·mean.

    """
    if len(x) == 0 or len(x_replay) == 0:
        raise ValueError(f"join_replay needs non-empty batches, got {len(x)} and {len(x_replay)} samples")
    weights = torch.cat(
        [torch.full((len(y),), 1.0 / len(y)), torch.full((len(y_replay),), replay_weight / len(y_replay))]
    ).to(x.device)
    return torch.cat([x, x_replay.to(x)]), torch.cat([y, y_replay.to(y)]), weights
