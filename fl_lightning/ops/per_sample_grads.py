"""Class-restricted per-sample gradients with torch.func (Deep Domain Isolation's features)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap


def per_class_losses(logits: Tensor, mask: Tensor, num_classes: int) -> Tensor:
    """Per class c: mean of −log p_c over the pixels whose label is c (0 where the class is absent).

    Args:
        logits: (C, H, W) logits of ONE sample.
        mask: (H, W) integer labels of that sample.
        num_classes: C.

    Returns:
        A (C,) vector of losses.
    """
    logp = torch.log_softmax(logits, dim=0)
    # a comparison, not F.one_hot: one_hot checks its input's range, which vmap cannot trace
    classes = torch.arange(num_classes, device=mask.device).view(num_classes, 1, 1)
    onehot = (mask.unsqueeze(0) == classes).to(logp.dtype)
    count = onehot.sum(dim=(1, 2))
    return -(logp * onehot).sum(dim=(1, 2)) / count.clamp_min(1)


def class_restricted_gradients(
    model: nn.Module, images: Tensor, masks: Tensor, num_classes: int, chunk_size: int = 16
) -> Tensor:
    """Gradient of every class's restricted loss, for every sample, w.r.t. every trainable parameter.

    Computed with ``vmap`` over samples of ``jacrev`` over the class losses, in chunks of
    ``chunk_size`` samples so memory stays bounded. The model is used in eval mode (normalisation
    layers with their running statistics, as at the pre-trained point where DDI is taken).

    Args:
        model: A segmentation network mapping (N, C_in, H, W) to (N, C, H, W) logits.
        images: (N, C_in, H, W).
        masks: (N, H, W) labels.
        num_classes: C.
        chunk_size: Samples per vmap chunk.

    Returns:
        (N, C, P) gradients (P = number of trainable parameters, flattened in ``named_parameters``
        order); rows of classes absent from a sample's mask are zero.
    """
    was_training = model.training
    model.eval()
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def losses(p: dict[str, Tensor], x: Tensor, m: Tensor) -> Tensor:
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))[0]
        return per_class_losses(out, m, num_classes)

    per_sample = vmap(jacrev(losses), in_dims=(None, 0, 0), chunk_size=chunk_size)
    try:
        jac = per_sample(params, images, masks)
    finally:
        model.train(was_training)
    return torch.cat([jac[k].reshape(len(images), num_classes, -1) for k in params], dim=2)


def prune_indices(num_params: int, fraction: float, seed: int) -> Tensor:
    """The coordinates pruned DDI keeps: a seeded random subset, identical on every client for a seed."""
    if not 0 < fraction <= 1:
        raise ValueError(f"prune_fraction must be in (0, 1], got {fraction}")
    k = max(1, round(fraction * num_params))
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_params, generator=g)[:k].sort().values


def normalise_rows(vectors: Tensor, eps: float = 1e-12) -> Tensor:
    """Each row divided by its L2 norm."""
    return vectors / vectors.norm(dim=-1, keepdim=True).clamp_min(eps)
