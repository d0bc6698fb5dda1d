"""A client's validation split, carved out of its training data: seeded, stratified, by whole cases where known."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from datamodules.sampler import stable_seed
from datamodules.split import split_train_test

if TYPE_CHECKING:
    from datamodules.base import ClientSplit


def carve_validation(
    labels: torch.Tensor, cases: torch.Tensor | None, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Training and validation positions of one client's training samples.

    Without cases, :func:`~datamodules.split.split_train_test` over the samples: ``round(n * val_fraction)`` of
    them, stratified by label for classification (1-D labels), uniformly at random for segmentation masks; at least
    one training sample stays. With cases (a patient's, volume's or scan's samples), the same over the cases, each
    labelled with its most frequent class for classification, so no case is in both sets. Survival labels
    ``(time, event)`` are stratified by event.

    Args:
        labels: The client's training labels (N,), masks (N, H, W) or survival pairs (N, 2).
        cases: A case id per training sample (N,), or None.
        val_fraction: Fraction held out, in [0, 1).
        seed: The split's seed.

    Returns:
        ``(train, val)``: sorted int64 position arrays, disjoint, together ``0 … N-1``.
    """
    n = len(labels)
    if labels.is_floating_point():  # survival (time, event) pairs: stratified by event
        strata = labels[:, 1].long().numpy()
    else:
        strata = labels.numpy() if labels.ndim == 1 else np.zeros(n, dtype=np.int64)
    if cases is None:
        return split_train_test(np.arange(n), strata, val_fraction, seed)
    ids, per_sample = np.unique(cases.numpy(), return_inverse=True)
    case_strata = np.array([np.bincount(strata[per_sample == c]).argmax() for c in range(len(ids))], dtype=np.int64)
    _, val_cases = split_train_test(np.arange(len(ids)), case_strata, val_fraction, seed)
    in_val = np.isin(per_sample, val_cases)
    return np.flatnonzero(~in_val).astype(np.int64), np.flatnonzero(in_val).astype(np.int64)


def with_validation(split: ClientSplit, val_fraction: float, seed: int, source: str) -> ClientSplit:
    """The client's split with validation tensors: its official ones, carved ones, or empty ones.

    A split that brings ``val_x``/``val_y`` (an official validation split) is kept as it is. Otherwise, with
    ``val_fraction`` > 0, :func:`carve_validation` (seed ``stable_seed(seed, "val", client)``) moves part of the
    training data to validation; with 0, the training data stay as they are (the same tensors) and the validation
    tensors are empty.

    Raises:
        ValueError: If ``val_fraction`` > 0 leaves the client no validation sample, naming it, its training
            samples (or cases) and what to do.
    """
    if split.val_x is not None and split.val_y is not None:
        return split
    x, y = split.train_x, split.train_y
    if val_fraction <= 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return dataclasses.replace(
            split, val_x=x[:0], val_y=y[:0], val_domain=None if split.train_domain is None else empty
        )
    train, val = carve_validation(y, split.train_case, val_fraction, stable_seed(seed, "val", split.client_id))
    if not len(val):
        what = "samples" if split.train_case is None else "cases"
        count = len(y) if split.train_case is None else len(torch.unique(split.train_case))
        raise ValueError(
            f"client {split.client_id!r} has {count} training {what}: data.init_args.val_fraction={val_fraction} "
            f"leaves it no validation {what[:-1]} ({source}); raise val_fraction, give it more data or leave it out"
        )
    keep, held = torch.from_numpy(train), torch.from_numpy(val)

    def part(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
        return None if t is None else t[index]

    return dataclasses.replace(
        split,
        train_x=x[keep],
        train_y=y[keep],
        train_domain=part(split.train_domain, keep),
        train_case=part(split.train_case, keep),
        val_x=x[held],
        val_y=y[held],
        val_domain=part(split.train_domain, held),
    )
