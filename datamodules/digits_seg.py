"""Embedded segmentation data: three digits of {0, 1, 3, 4} per image, mask = digit class, per-site imaging styles."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from typing_extensions import override

from datamodules.assemble import convert_channels, resize_images, subsample
from datamodules.base import ClientSplit, FederatedDataModule
from datamodules.embedded_digits import load_digits
from datamodules.partition import partition
from datamodules.sampler import stable_seed
from datamodules.shifts import SiteStyle, StyleSpec, apply_style, resolve_site_styles, style_name
from datamodules.split import split_train_test

SEG_DIGITS = (0, 1, 3, 4)  # digit d is class SEG_DIGITS.index(d) + 1; class 0 is the background
SEG_PARTITIONS = ("iid", "domain", "dirichlet_domain")
_DIGIT_FRACTION = 0.4  # a digit's side relative to the image side; the rest of its quadrant is jitter room
_MASK_THRESHOLD = 0.3  # scan intensity (in [0, 1], before styling) above which a pixel belongs to the digit


def digit_size(image_size: int) -> int:
    """Side in pixels of one pasted digit in an ``image_size`` canvas."""
    return max(2, round(_DIGIT_FRACTION * image_size))


def compose(scans: Tensor, classes: np.ndarray, pool: np.ndarray, image_size: int, seed: int, k: int = 3):
    """One canvas with ``k`` digits drawn from ``pool``, each in its own quadrant at a random offset.

    Args:
        scans: Resized digit scans (S, 1, d, d) in [0, 1].
        classes: Class id (1 …) of every scan.
        pool: Scan indices this image may use (the train or the test pool).
        image_size: Canvas side.
        seed: Seed of this image (quadrants, scans, offsets).
        k: Digits per image (at most 4: one per quadrant, so digits never overlap).

    Returns:
        ``(image (1, S, S) float32, mask (S, S) int64)``.

    """
    rng = np.random.default_rng(seed)
    d, half = scans.shape[-1], image_size // 2
    image = torch.zeros(1, image_size, image_size)
    mask = torch.zeros(image_size, image_size, dtype=torch.int64)
    for quadrant in rng.choice(4, size=k, replace=False):
        scan = int(pool[rng.integers(len(pool))])
        top = (quadrant // 2) * half + int(rng.integers(0, max(half - d, 0) + 1))
        left = (quadrant % 2) * half + int(rng.integers(0, max(half - d, 0) + 1))
        digit = scans[scan, 0, : image_size - top, : image_size - left]
        h, w = digit.shape
        image[0, top : top + h, left : left + w] = digit
        mask[top : top + h, left : left + w][digit > _MASK_THRESHOLD] = int(classes[scan])
    return image, mask


class DigitsSegFederated(FederatedDataModule):
    """Segmentation of handwritten digits (``sklearn.datasets.load_digits``) over ``num_clients`` sites; no download.

    Each image is a canvas with three digits of {0, 1, 3, 4} (one per quadrant, random offsets, real 8×8
    scans resized to 40 % of the side); its mask holds the digit class per pixel (1–4; 0 background), so
    there are 5 classes. The scans are split once into a training and a test pool (``test_fraction``,
    stratified by digit), so a test image never shows a scan seen in training. Images are partitioned over
    clients (``iid``, or by domain), each client's test images are held out, and client ``i`` images
    everything with site style ``i`` (clean; gamma + low contrast; inverted; blurred + gain; noisy + low
    contrast; then seeded random styles).

    A second domain for domain-clustering methods: each image is intensity-inverted (before the site
    style) with probability ``inverted_fraction``; ``train_domain``/``test_domain`` hold 1 for inverted
    images and 0 otherwise, and ``partition=domain`` / ``dirichlet_domain`` split clients by it (client
    ``i`` gets domain ``i % 2``, or a Dirichlet(``alpha``) mix). With inversion you will usually also set
    ``site_styles=false``: site 2's style is itself an inversion.

    Everything is seeded by ``seed``: the same arguments give the same tensors in every run.

    Args:
        num_clients: Number of clients (sites); ids ``site0``, ``site1``, …
        image_size: Side of the square images.
        num_samples: Images generated in total, before partitioning.
        channels: 1 (gray) or 3 (gray replicated, then styled, so colour tints apply).
        inverted_fraction: Probability that an image belongs to the inverted domain, in [0, 1].
        partition: ``iid``, ``domain`` or ``dirichlet_domain`` (the latter two over the inversion domain).
        alpha: Dirichlet concentration over domains for ``dirichlet_domain``.
        site_styles: Per-site imaging styles: ``true`` (the sequence above), ``false`` (none), or a list of one
            style per site: a name (``clean``, ``low_contrast``, ``dark``, ``noisy``, ``inverted``, ``random``, …),
            parameters on top of a name (``low_contrast+noise_std=0.05``) or a mapping of ``SiteStyle`` fields;
            see ``datamodules.shifts`` for every name and parameter.
        max_samples_per_client: Cap on each client's images before the train/test split (None: no cap).
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's images (and of the digit scans) held out for testing.
        val_fraction: Fraction of each client's training samples held out as its validation set
            (default 0: none; see :class:`~datamodules.base.FederatedDataModule`).
        seed: Seed of composition, partition, styles, split and shuffling.

    Raises:
        ValueError: On an invalid argument, naming it.

    """

    def __init__(
        self,
        *,
        num_clients: int = 5,
        image_size: int = 32,
        num_samples: int = 1000,
        channels: int = 1,
        inverted_fraction: float = 0.0,
        partition: str = "iid",
        alpha: float = 0.5,
        site_styles: bool | list[StyleSpec] = True,
        max_samples_per_client: int | None = None,
        batch_size: int = 16,
        eval_batch_size: int = 128,
        test_fraction: float = 0.2,
        val_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            test_fraction=test_fraction,
            seed=seed,
            val_fraction=val_fraction,
        )
        checks = {
            "num_clients": num_clients >= 1,
            "image_size": image_size >= 4,
            "num_samples": num_samples >= num_clients,
            "channels": channels in (1, 3),
            "inverted_fraction": 0.0 <= inverted_fraction <= 1.0,
            "partition": partition in SEG_PARTITIONS,
            "alpha": alpha > 0,
            "max_samples_per_client": max_samples_per_client is None or max_samples_per_client >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            got = ", ".join(f"{k}={v!r}" for k, v in locals().items() if k in bad)
            raise ValueError(
                f"DigitsSegFederated: invalid {got} (image_size >= 4, num_samples >= num_clients, channels 1 or 3, "
                f"inverted_fraction in [0, 1], partition one of {SEG_PARTITIONS}, alpha > 0)"
            )
        self.num_clients = num_clients
        self.size = image_size
        self.num_samples = num_samples
        self.channels = channels
        self.inverted_fraction = inverted_fraction
        self.partition = partition
        self.alpha = alpha
        self.site_styles = site_styles
        resolve_site_styles(site_styles, num_clients, seed, channels)  # a bad style fails here, not at setup
        self.max_samples_per_client = max_samples_per_client
        self._declared_num_classes = len(SEG_DIGITS) + 1
        self._source = "digits_seg"

    @override
    def label_names(self) -> list[str]:
        """``background``, then the digits in mask-class order (class d + 1 is digit ``SEG_DIGITS[d]``)."""
        return ["background", *(f"digit {d}" for d in SEG_DIGITS)]

    @override
    def image_sources(self, client_id: str) -> tuple[list[str], str] | None:
        """Site ``i``'s style for each of its images: here the domain is the inversion, not the style."""
        if self.site_styles is False:
            return super().image_sources(client_id)
        n = self.num_train_samples(client_id)
        return [style_name(self.site_styles, self.client_ids.index(client_id))] * n, "styles"

    def _scans(self) -> tuple[Tensor, np.ndarray]:
        """The {0, 1, 3, 4} scans resized to the digit size, and their class ids (1 …)."""
        images, target = load_digits()
        keep = np.isin(target, SEG_DIGITS)
        classes = np.searchsorted(SEG_DIGITS, target[keep]).astype(np.int64) + 1
        scans = torch.as_tensor(images[keep], dtype=torch.float32).unsqueeze(1) / 16.0
        return resize_images(scans, digit_size(self.size)), classes

    def _load(self) -> list[ClientSplit]:
        scans, classes = self._scans()
        train_pool, test_pool = split_train_test(
            np.arange(len(classes)), classes, self.test_fraction, stable_seed(self.seed, "scan_split")
        )
        rng = np.random.default_rng(stable_seed(self.seed, "inverted"))
        domains = (rng.random(self.num_samples) < self.inverted_fraction).astype(np.int64)
        parts = partition(
            domains, self.partition, self.num_clients, stable_seed(self.seed, "partition"), alpha=self.alpha,
            domains=domains if self.partition != "iid" else None,
        )  # fmt: skip
        parts = subsample(parts, self.max_samples_per_client, self.seed)
        styles = resolve_site_styles(self.site_styles, self.num_clients, self.seed, self.channels) or (
            [SiteStyle()] * self.num_clients
        )
        splits = []
        for client, idx in enumerate(parts):
            cid = f"site{client}"
            train, test = split_train_test(idx, domains, self.test_fraction, stable_seed(self.seed, "split", cid))
            arrays = []
            for subset, pool in ((train, train_pool), (test, test_pool)):
                x, y = self._render(subset, pool, scans, classes, domains)
                x = apply_style(x, styles[client], seed=stable_seed(self.seed, "style", cid)) if len(x) else x
                arrays.append((x.contiguous(), y, torch.as_tensor(domains[subset], dtype=torch.int64)))
            (train_x, train_y, train_d), (test_x, test_y, test_d) = arrays
            splits.append(ClientSplit(cid, train_x, train_y, test_x, test_y, train_d, test_d))
        return splits

    def _render(
        self, subset: np.ndarray, pool: np.ndarray, scans: Tensor, classes: np.ndarray, domains: np.ndarray
    ) -> tuple[Tensor, Tensor]:
        """Images and masks of the given image indices, composed from ``pool``; inverted where the domain is 1."""
        size = self.size
        if len(subset) == 0:
            return torch.zeros(0, self.channels, size, size), torch.zeros(0, size, size, dtype=torch.int64)
        if len(pool) == 0:
            raise ValueError("digits_seg: the digit-scan pool is empty; lower test_fraction")
        pairs = [compose(scans, classes, pool, size, stable_seed(self.seed, "compose", int(i))) for i in subset]
        x = torch.stack([p[0] for p in pairs])
        y = torch.stack([p[1] for p in pairs])
        inverted = torch.as_tensor(domains[subset] == 1)
        x[inverted] = 1.0 - x[inverted]
        return convert_channels(x, self.channels), y
