"""Embedded federated digits: scikit-learn's 1797 real 8x8 scans split over sites with per-site imaging styles."""

from __future__ import annotations

import numpy as np
import torch

from datamodules.assemble import build_client_splits, convert_channels, resize_images, subsample
from datamodules.base import ClientSplit, FederatedDataModule, check_image_args
from datamodules.embedded_digits import load_digits
from datamodules.partition import PARTITION_SCHEMES, check_clients_fit, partition
from datamodules.sampler import stable_seed
from datamodules.shifts import SiteStyle, StyleSpec, resolve_site_styles

# Number of distinct domains (imaging styles) used by the domain-based partitions; matches the five fixed styles.
_MAX_DOMAINS = 5


def binary_subsample(labels: np.ndarray, positive_fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of a seeded subsample of 0/1 ``labels`` whose share of ones is ``positive_fraction``.

    The side above its target share is subsampled (without replacement), the other side is kept whole.

    Args:
        labels: Binary labels (0 negative, 1 positive), both present.
        positive_fraction: Target share of positives in (0, 1).
        seed: Seed of the subsample.

    Returns:
        Sorted int64 indices into ``labels``.

    """
    pos, neg = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError(f"positive_fraction needs both classes, got {len(pos)} positives and {len(neg)} negatives")
    rng = np.random.default_rng(seed)
    if len(pos) / (len(pos) + len(neg)) <= positive_fraction:
        n_neg = max(1, round(len(pos) * (1.0 - positive_fraction) / positive_fraction))
        neg = rng.choice(neg, size=min(n_neg, len(neg)), replace=False)
    else:
        n_pos = max(1, round(len(neg) * positive_fraction / (1.0 - positive_fraction)))
        pos = rng.choice(pos, size=min(n_pos, len(pos)), replace=False)
    return np.sort(np.concatenate([pos, neg])).astype(np.int64)


class DigitsFederated(FederatedDataModule):
    """Handwritten digits (``sklearn.datasets.load_digits``) split over ``num_clients`` sites; nothing downloaded.

    Flow: every sample is partitioned over clients; for the ``"domain"`` and ``"dirichlet_domain"`` schemes each
    sample first gets a seeded random domain in ``range(min(num_clients, 5))`` (``range(len(site_styles))`` when
    ``site_styles`` is a list) and is partitioned by it (its style is its domain's style), otherwise client ``i``
    gets style ``i``. Styles are applied once per client, then each client's samples are split into train and
    test (stratified). Client ids are ``"site0"``, ``"site1"``, ...
    ``train_domain``/``test_domain`` hold each sample's style index.

    Args:
        num_clients: Number of clients (sites).
        image_size: Side of the square images; the 8x8 scans are resized bilinearly.
        channels: 1 (gray) or 3 (gray replicated before styling, so colour tints apply).
        partition: Partition scheme: "iid", "dirichlet", "pathological", "domain" or "dirichlet_domain".
        alpha: Dirichlet concentration for "dirichlet" (over labels) and "dirichlet_domain" (over domains).
        classes_per_client: Classes per client for "pathological".
        site_styles: Per-site imaging styles: ``true`` (site ``i`` gets fixed style ``i``: clean; gamma + low
            contrast; inverted; blurred + gain; noisy + low contrast; then seeded random ones, RGB sites tinted),
            ``false`` (none), or a list of one style per site (per domain for the domain partitions), each a name
            (``clean``, ``low_contrast``, ``dark``, ``noisy``, ``inverted``, ``random``, …), parameters on top of
            a name (``low_contrast+noise_std=0.05``) or a mapping of ``SiteStyle`` fields; see
            ``datamodules.shifts`` for every name and parameter.
        max_samples_per_client: Cap on each client's samples before the train/test split (None: no cap).
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's samples held out as its test set.
        val_fraction: Fraction of each client's training samples held out as its validation set
            (default 0: none; see :class:`~datamodules.base.FederatedDataModule`).
        seed: Seed for partitioning, styling, splitting and shuffling.
        binary_positive: Turn the task into one digit against the rest: label 1 for this digit (0–9), label 0 for
            every other digit, ``num_classes`` 2. None (default): the 10-class task.
        positive_fraction: With ``binary_positive``: the share of positives (in (0, 1)) after subsampling the
            pooled data (seeded, before partitioning): the larger side is subsampled, the smaller one kept whole;
            e.g. digit 0 (178 scans) at 0.15 keeps its 178 scans and 1009 of the other 1619. None: no subsampling
            (about 10 % positives).

    Raises:
        ValueError: On an invalid argument, naming it.

    """

    def __init__(
        self,
        *,
        num_clients: int = 5,
        image_size: int = 16,
        channels: int = 1,
        partition: str = "iid",
        alpha: float = 0.5,
        classes_per_client: int = 2,
        site_styles: bool | list[StyleSpec] = True,
        max_samples_per_client: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int = 256,
        test_fraction: float = 0.2,
        val_fraction: float = 0.0,
        seed: int = 0,
        binary_positive: int | None = None,
        positive_fraction: float | None = None,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            test_fraction=test_fraction,
            seed=seed,
            val_fraction=val_fraction,
        )
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        check_image_args(image_size, channels)
        if partition not in PARTITION_SCHEMES:
            raise ValueError(f"partition must be one of {', '.join(PARTITION_SCHEMES)}; got {partition!r}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        if classes_per_client < 1:
            raise ValueError(f"classes_per_client must be >= 1, got {classes_per_client}")
        if max_samples_per_client is not None and max_samples_per_client < 1:
            raise ValueError(f"max_samples_per_client must be >= 1 or None, got {max_samples_per_client}")
        if binary_positive is not None and not 0 <= binary_positive <= 9:
            raise ValueError(f"binary_positive must be a digit 0-9 or None, got {binary_positive}")
        if positive_fraction is not None:
            if binary_positive is None:
                raise ValueError("positive_fraction needs binary_positive (the digit that is the positive class)")
            if not 0.0 < positive_fraction < 1.0:
                raise ValueError(f"positive_fraction must be in (0, 1), got {positive_fraction}")
        self.binary_positive = binary_positive
        self.positive_fraction = positive_fraction
        self.num_clients = num_clients
        self.size = image_size
        self.channels = channels
        self.partition = partition
        self.alpha = alpha
        self.classes_per_client = classes_per_client
        self.site_styles = site_styles
        self.max_samples_per_client = max_samples_per_client
        self._declared_num_classes = 10 if binary_positive is None else 2
        self._source = "digits"
        resolve_site_styles(site_styles, self._num_styles(), seed, channels)  # a bad style fails here, not at setup

    def _num_styles(self) -> int:
        """Styles needed: one per domain for the domain partitions (a list sets the domains), else one per client."""
        if self.partition not in ("domain", "dirichlet_domain"):
            return self.num_clients
        if isinstance(self.site_styles, (list, tuple)):
            return len(self.site_styles)
        return min(self.num_clients, _MAX_DOMAINS)

    def _load(self) -> list[ClientSplit]:
        scans, labels = load_digits()
        images = torch.as_tensor(scans, dtype=torch.float32).unsqueeze(1) / 16.0
        images = convert_channels(resize_images(images, self.size), self.channels)
        if self.binary_positive is not None:
            labels = (labels == self.binary_positive).astype(np.int64)
            if self.positive_fraction is not None:
                keep = binary_subsample(labels, self.positive_fraction, stable_seed(self.seed, "binary"))
                labels, images = labels[keep], images[torch.as_tensor(keep)]

        check_clients_fit(len(labels), self.num_clients, self.test_fraction, self._source, self.max_samples_per_client)
        by_domain = self.partition in ("domain", "dirichlet_domain")
        domains = None
        if by_domain:
            rng = np.random.default_rng(stable_seed(self.seed, "domains"))
            domains = rng.integers(0, self._num_styles(), size=len(labels))
        parts = partition(
            labels,
            self.partition,
            self.num_clients,
            stable_seed(self.seed, "partition"),
            alpha=self.alpha,
            classes_per_client=self.classes_per_client,
            domains=domains,
        )
        parts = subsample(parts, self.max_samples_per_client, self.seed)

        if by_domain:
            style_index = domains
        else:
            style_index = np.empty(len(labels), dtype=np.int64)
            for client, idx in enumerate(parts):
                style_index[idx] = client
        num_styles = self._num_styles()
        styles = (
            resolve_site_styles(self.site_styles, num_styles, self.seed, self.channels) or [SiteStyle()] * num_styles
        )
        client_ids = [f"site{i}" for i in range(self.num_clients)]
        return build_client_splits(
            images, labels, parts, client_ids, self.test_fraction, self.seed, styles=styles, style_index=style_index
        )
