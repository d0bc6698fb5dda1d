"""FedER's privacy-preserving GAN losses and the LPIPS distance they use, as pure functions on tensors.

LPIPS (Zhang et al., 2018) between images x and x': d = Σ_l mean_{h,w} Σ_c w_{l,c} (â_{l,c,h,w} − â'_{l,c,h,w})²,
where â_l are the backbone's layer-l activations normalised to unit length over channels at every location
and w_l ≥ 0 the learnt linear heads. Computing it for every (synthetic, real) pair by calling LPIPS on each pair
would run the backbone |S|·|R| times; :func:`lpips_pairwise` takes the per-image features, computed once, and
expands the square instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def lpips_pairwise(features_a: Sequence[Tensor], features_b: Sequence[Tensor], weights: Sequence[Tensor]) -> Tensor:
    """LPIPS distance of every pair (a_i, b_j) from normalised per-layer features.

    Args:
        features_a: Per layer l, the unit-normalised activations of the first images, (Na, C_l, H_l, W_l).
        features_b: The same for the second images, (Nb, C_l, H_l, W_l).
        weights: Per layer l, the linear head's channel weights w_l, (C_l,).

    Returns:
        The (Na, Nb) matrix d_ij = Σ_l (1/(H_l W_l)) Σ_{c,h,w} w_{l,c} (a_{i,l,c,h,w} − b_{j,l,c,h,w})², expanded as
        Σw a² + Σw b² − 2 Σw a b (clamped at 0 against rounding).

    """
    total: Tensor | None = None
    for fa, fb, w in zip(features_a, features_b, weights, strict=True):
        w = w.view(1, -1, 1, 1).to(fa.dtype)
        weighted_a = (fa * w).flatten(1)
        a2 = (weighted_a * fa.flatten(1)).sum(1)
        b2 = (fb * fb * w).flatten(1).sum(1)
        cross = weighted_a @ fb.flatten(1).T
        layer = (a2[:, None] + b2[None, :] - 2 * cross) / (fa.shape[2] * fa.shape[3])
        total = layer if total is None else total + layer
    if total is None:
        raise ValueError("lpips_pairwise needs at least one layer of features")
    return total.clamp_min(0)


def privacy_loss(distances: Tensor) -> Tensor:
    """L_PP = −mean over all (synthetic, real) pairs of their LPIPS distance.

    Minimising it pushes every synthetic image perceptually away from every real one (labels are ignored).

    Args:
        distances: (N_synthetic, N_real) pairwise LPIPS distances, differentiable w.r.t. the synthetic images.

    """
    return -distances.mean()


def generator_loss(fake_logits: Tensor, distances: Tensor | None = None, privacy_weight: float = 1.0) -> Tensor:
    """L_G = non-saturating GAN loss + α·L_PP.

    Args:
        fake_logits: Discriminator logits of the generated batch, (N,).
        distances: Pairwise LPIPS distances between generated and real images (ignored when α = 0).
        privacy_weight: α ≥ 0; α = 0 gives the plain non-saturating GAN loss −mean log σ(D(G(z))).

    """
    loss = F.binary_cross_entropy_with_logits(fake_logits, torch.ones_like(fake_logits))
    if privacy_weight:
        if distances is None:
            raise ValueError("generator_loss needs the pairwise distances when privacy_weight > 0")
        loss = loss + privacy_weight * privacy_loss(distances)
    return loss


def discriminator_loss(real_logits: Tensor, fake_logits: Tensor) -> Tensor:
    """The standard GAN discriminator loss −mean log σ(D(x)) − mean log(1 − σ(D(G(z))))."""
    return F.binary_cross_entropy_with_logits(
        real_logits, torch.ones_like(real_logits)
    ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))


def nearest_lpips(
    query_features: Sequence[Tensor], pool_features: Sequence[Tensor], weights: Sequence[Tensor], chunk: int = 512
) -> tuple[Tensor, Tensor]:
    """For every query image, the LPIPS distance to its closest pool image and that image's index.

    Args:
        query_features: Per-layer normalised features of the images audited (e.g. real images), (Nq, C_l, H_l, W_l).
        pool_features: Per-layer features of the images searched (e.g. a large generated sample), (Np, ...).
        weights: Per-layer channel weights of the LPIPS heads.
        chunk: Pool images per distance block, bounding memory to Nq × chunk.

    Returns:
        ``(distances (Nq,), indices (Nq,))``.

    """
    num_pool = len(pool_features[0])
    if num_pool == 0:
        raise ValueError("nearest_lpips needs a non-empty pool")
    best, index = None, None
    for start in range(0, num_pool, chunk):
        block = [f[start : start + chunk] for f in pool_features]
        value, arg = lpips_pairwise(query_features, block, weights).min(dim=1)
        if best is None:
            best, index = value, arg
        else:
            better = value < best
            best, index = torch.where(better, value, best), torch.where(better, arg + start, index)
    return best, index
