"""MOON's model-contrastive loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def moon_contrastive_loss(z: Tensor, z_global: Tensor, z_previous: Tensor, temperature: float) -> Tensor:
    """ℓ_con = −log( e^{sim(z,z_g)/T} / (e^{sim(z,z_g)/T} + e^{sim(z,z_prev)/T}) ), averaged over the batch.

    Args:
        z: Representations of the model being trained, (N, D).
        z_global: Representations of the received global model, (N, D) (no gradient needed).
        z_previous: Representations of the client's previous local model, (N, D).
        temperature: T > 0.

    """
    pos = F.cosine_similarity(z, z_global, dim=1) / temperature
    neg = F.cosine_similarity(z, z_previous, dim=1) / temperature
    logits = torch.stack([pos, neg], dim=1)
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))
