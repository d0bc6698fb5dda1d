"""Turns a pooled dataset plus a partition into per-client :class:`ClientSplit` objects.

Shared by every datamodule built from one pooled array (digits, MedMNIST): optional subsampling, the per-site style
(applied once, seeded per client) and the stratified per-client train/test split.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from datamodules.base import ClientSplit
from datamodules.sampler import stable_seed
from datamodules.shifts import SiteStyle, apply_style
from datamodules.split import split_train_test


def resize_images(images: Tensor, size: int) -> Tensor:
    """Resizes an (N, C, H, W) batch to (N, C, size, size) with bilinear interpolation, values kept in [0, 1].

    Args:
        images: Float images.
        size: Target height and width.

    Returns:
        The resized images (the input itself if it already has that size).

    """
    if tuple(images.shape[2:]) == (size, size):
        return images
    resized = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=False)
    return resized.clamp(0.0, 1.0)


def convert_channels(images: Tensor, channels: int) -> Tensor:
    """Converts an (N, C, H, W) batch between 1 and 3 channels (mean to gray, repeat to RGB).

    Args:
        images: Float images with 1 or 3 channels.
        channels: Target channel count, 1 or 3.

    Returns:
        The converted images.

    Raises:
        ValueError: If the conversion is not between 1 and 3 channels.

    """
    have = images.shape[1]
    if have == channels:
        return images
    if have == 3 and channels == 1:
        return images.mean(dim=1, keepdim=True)
    if have == 1 and channels == 3:
        return images.repeat(1, 3, 1, 1)
    raise ValueError(f"cannot convert {have}-channel images to {channels} channels (only 1 <-> 3)")


def subsample(parts: list[np.ndarray], max_per_client: int | None, seed: int) -> list[np.ndarray]:
    """Caps every client's index array at ``max_per_client`` samples, chosen at random (seeded per client).

    Args:
        parts: Sorted index arrays, one per client.
        max_per_client: The cap; ``None`` keeps everything.
        seed: Base seed.

    Returns:
        Sorted index arrays, one per client.

    """
    if max_per_client is None:
        return parts
    out = []
    for client, idx in enumerate(parts):
        if len(idx) > max_per_client:
            rng = np.random.default_rng(stable_seed(seed, "subsample", client))
            idx = np.sort(rng.choice(idx, size=max_per_client, replace=False))
        out.append(idx)
    return out


def build_client_splits(
    images: Tensor,
    labels: np.ndarray,
    parts: list[np.ndarray],
    client_ids: list[str],
    test_fraction: float,
    seed: int,
    *,
    styles: list[SiteStyle] | None = None,
    style_index: np.ndarray | None = None,
) -> list[ClientSplit]:
    """Builds every client's styled, split tensors from the pooled dataset and a partition.

    Args:
        images: Pooled float32 images (N, C, H, W) in [0, 1].
        labels: Pooled integer labels (N,).
        parts: One index array per client (from a partitioner).
        client_ids: One id per client.
        test_fraction: Per-client test fraction.
        seed: Base seed; the style of client ``c`` and style ``s`` uses ``stable_seed(seed, "style", c, s)`` and
            the split uses ``stable_seed(seed, "split", c)``.
        styles: Styles to apply; ``None`` applies none.
        style_index: Style id per pooled sample (indexes ``styles``); required with ``styles``. Also stored as
            the clients' ``train_domain``/``test_domain``.

    Returns:
        One :class:`ClientSplit` per client.

    """
    labels = np.asarray(labels, dtype=np.int64)
    out: list[ClientSplit] = []
    for client_id, idx in zip(client_ids, parts, strict=True):
        x = images[torch.as_tensor(idx)]
        domain = style_index[idx] if style_index is not None else None
        if styles is not None and domain is not None:
            # Style once here; the result is cached in the ClientSplit, so it is identical in every round.
            x = x.clone()
            for s in np.unique(domain):
                mask = torch.as_tensor(domain == s)
                x[mask] = apply_style(x[mask], styles[int(s)], seed=stable_seed(seed, "style", client_id, int(s)))
        train, test = split_train_test(idx, labels, test_fraction, stable_seed(seed, "split", client_id))
        dom = torch.as_tensor(domain, dtype=torch.int64) if domain is not None else None
        local_labels = torch.as_tensor(labels[idx], dtype=torch.int64)  # labels[train] = this at train's positions
        out.append(
            client_split(client_id, x, local_labels, dom, np.searchsorted(idx, train), np.searchsorted(idx, test))
        )
    return out


def client_split(
    client_id: str, x: Tensor, labels: Tensor, domain: Tensor | None, train: np.ndarray, test: np.ndarray
) -> ClientSplit:
    """A client's split: rows ``train`` and ``test`` of ``x``, ``labels`` (int64) and, if given, ``domain``."""
    tr, te = torch.as_tensor(train), torch.as_tensor(test)
    return ClientSplit(
        client_id=client_id,
        train_x=x[tr].contiguous(),
        train_y=labels[tr],
        test_x=x[te].contiguous(),
        test_y=labels[te],
        train_domain=domain[tr] if domain is not None else None,
        test_domain=domain[te] if domain is not None else None,
    )
