"""Per-client train/test split and the label checks every datamodule shares."""

from __future__ import annotations

import math

import numpy as np
import torch


def split_train_test(
    indices: np.ndarray, labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Splits one client's samples into train and test, stratified by label where possible.

    The test set gets ``round(n * test_fraction)`` samples (at most ``n - 1``). Each class first contributes
    ``floor(n_c * test_fraction)`` samples, keeping at least one of its samples for training; the remaining test
    quota goes to the classes with the largest fractional remainders, still keeping one training sample per
    class, and only if that is not enough may a class move entirely to test. Every client therefore keeps at least
    one training sample, and classes seen in test are normally seen in training too.

    Args:
        indices: The client's sample indices (any integer array).
        labels: Label array indexed by ``indices`` (``labels[indices]`` are the client's labels).
        test_fraction: Fraction of samples held out for testing, in [0, 1).
        seed: Seed for the choice of test samples.

    Returns:
        ``(train_indices, test_indices)``: sorted int64 arrays, disjoint, together equal to ``indices``.

    Raises:
        ValueError: If ``test_fraction`` is outside [0, 1).

    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    indices = np.asarray(indices, dtype=np.int64)
    client_labels = np.asarray(labels)[indices]
    n = len(indices)
    target = min(math.floor(n * test_fraction + 0.5), max(n - 1, 0))

    classes, counts = np.unique(client_labels, return_counts=True)
    exact = counts * test_fraction
    quota = np.minimum(np.floor(exact).astype(np.int64), counts - 1)
    remaining = target - int(quota.sum())
    # Stable sort on the remainders keeps the tie order (class order) deterministic.
    order = np.argsort(-(exact - np.floor(exact)), kind="stable")
    for keep_one in (1, 0):
        for c in order:
            if remaining <= 0:
                break
            if quota[c] < counts[c] - keep_one:
                quota[c] += 1
                remaining -= 1

    rng = np.random.default_rng(seed)
    test_parts = [rng.permutation(indices[client_labels == cls])[:q] for cls, q in zip(classes, quota, strict=True)]
    test = np.sort(np.concatenate(test_parts)) if test_parts else np.empty(0, dtype=np.int64)
    train = np.setdiff1d(indices, test)
    return train, test


def check_labels(labels: torch.Tensor | np.ndarray, num_classes: int, client: str, source: str) -> None:
    """Checks that all labels are integers in ``[0, num_classes)``.

    Args:
        labels: Labels to check.
        num_classes: Number of classes.
        client: Client id (or split name) for the message.
        source: Where the labels came from (a file, a directory, or ``"digits"``) for the message.

    Raises:
        ValueError: Naming the client, the source and the offending label value.

    """
    values = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels)
    if values.numel() == 0:
        return
    bad = values[(values < 0) | (values >= num_classes)]
    if bad.numel():
        raise ValueError(f"label {bad[0].item()} out of range [0, {num_classes}) for client {client!r} in {source}")
