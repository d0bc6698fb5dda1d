"""MedMNIST-format ``.npz`` files (what users bring; nothing is downloaded), pooled and re-split over clients."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from datamodules.assemble import build_client_splits, convert_channels, resize_images, subsample
from datamodules.base import ClientSplit, FederatedDataModule
from datamodules.partition import check_clients_fit, partition
from datamodules.sampler import stable_seed
from datamodules.shifts import StyleSpec, resolve_site_styles

_SPLITS = ("train", "val", "test")
_KEYS = "{train,val,test}_{images,labels}"
# MedMNIST files carry no site/domain ids, so only label-based schemes apply.
_SCHEMES = ("iid", "dirichlet", "pathological")


def _read_split(archive: np.lib.npyio.NpzFile, split: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Reads and checks ``<split>_images`` / ``<split>_labels``; returns uint8 (N, H, W[, 3]) and int64 (N,)."""
    arrays = []
    for key in (f"{split}_images", f"{split}_labels"):
        if key not in archive.files:
            raise KeyError(f"key {key!r} missing from {path} (keys present: {', '.join(sorted(archive.files))})")
        try:
            arrays.append(archive[key])
        except ValueError as err:  # numpy's own message advises unsafe loading (allow_pickle=True): not ours to give
            raise ValueError(
                f"{path}: array {key!r} cannot be read as a plain numeric array (it holds Python objects or is "
                f"damaged): {type(err).__name__}; store uint8 images and integer labels"
            ) from None
    images, labels = arrays
    if images.dtype != np.uint8 or not (images.ndim == 3 or (images.ndim == 4 and images.shape[-1] == 3)):
        raise ValueError(
            f"{path}: {split}_images must be uint8 (N, H, W) or (N, H, W, 3), got {images.dtype} {images.shape}"
        )
    if labels.ndim == 2 and labels.shape[1] > 1:
        raise ValueError(
            f"{path}: {split}_labels has {labels.shape[1]} columns; multi-label data (e.g. chestmnist) is not "
            "supported, only single-label classification"
        )
    if labels.ndim not in (1, 2) or len(labels) != len(images):
        raise ValueError(
            f"{path}: {split}_labels must have shape ({len(images)},) or ({len(images)}, 1), got {labels.shape}"
        )
    labels = labels.reshape(-1)
    # Some converters store labels as floats; accept them only if every value is a whole number.
    whole = np.issubdtype(labels.dtype, np.integer) or (
        np.issubdtype(labels.dtype, np.floating) and bool(np.all(np.mod(labels, 1) == 0))
    )
    if not whole:
        raise ValueError(f"{path}: {split}_labels must be integers, got dtype {labels.dtype}")
    return images, labels.astype(np.int64)


def _to_tensor(images: np.ndarray) -> Tensor:
    """uint8 (N, H, W[, 3]) -> float32 (N, C, H, W) in [0, 1]."""
    x = torch.as_tensor(images, dtype=torch.float32) / 255.0
    return x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2).contiguous()


class MedMNISTFederated(FederatedDataModule):
    """A MedMNIST-format ``.npz`` (train/val/test images and labels) pooled and split over clients.

    All three splits are pooled, partitioned over ``num_clients`` clients (ids ``"client0"``, ...), optionally
    styled per client, and split per client into train and test (stratified).

    Args:
        path: Path to the ``.npz`` file (keys ``{train,val,test}_{images,labels}``; images uint8 (N, H, W) or
            (N, H, W, 3); labels (N,) or (N, 1)).
        num_clients: Number of clients.
        partition: Partition scheme: "iid", "dirichlet" or "pathological".
        alpha: Dirichlet concentration for "dirichlet".
        classes_per_client: Classes per client for "pathological".
        image_size: Resize images to this side (None keeps the file's size).
        channels: Convert images to 1 or 3 channels (None keeps the file's).
        num_classes: Number of classes (None infers max label + 1).
        site_styles: Per-client imaging styles: ``true`` (client ``i`` gets site style ``i``: clean; gamma + low
            contrast; inverted; blurred + gain; noisy + low contrast; then seeded random ones, RGB clients
            tinted), ``false`` (none), or a list of one style per client: a name (``clean``, ``low_contrast``,
            ``dark``, ``noisy``, ``random``, …), parameters on top of a name (``low_contrast+noise_std=0.05``) or a
            mapping of ``SiteStyle`` fields; see ``datamodules.shifts`` for every name and parameter.
        max_samples_per_client: Cap on each client's samples before the train/test split (None: no cap).
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's samples held out as its test set.
        seed: Seed for partitioning, styling, splitting and shuffling.

    Raises:
        ValueError: On an invalid argument, naming it. Data errors (missing file or key, multi-label file, label
            out of range) are raised when the data is first loaded.

    """

    def __init__(
        self,
        path: str | Path,
        *,
        num_clients: int = 5,
        partition: str = "iid",
        alpha: float = 0.5,
        classes_per_client: int = 2,
        image_size: int | None = None,
        channels: int | None = None,
        num_classes: int | None = None,
        site_styles: bool | list[StyleSpec] = False,
        max_samples_per_client: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int = 256,
        test_fraction: float = 0.2,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, test_fraction=test_fraction, seed=seed)
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        if partition not in _SCHEMES:
            raise ValueError(f"partition must be one of {', '.join(_SCHEMES)} for MedMNIST files; got {partition!r}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        if image_size is not None and image_size < 1:
            raise ValueError(f"image_size must be >= 1 or None, got {image_size}")
        if channels not in (None, 1, 3):
            raise ValueError(f"channels must be 1, 3 or None, got {channels}")
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"num_classes must be >= 1 or None, got {num_classes}")
        if max_samples_per_client is not None and max_samples_per_client < 1:
            raise ValueError(f"max_samples_per_client must be >= 1 or None, got {max_samples_per_client}")
        self.path = Path(path)
        self.num_clients = num_clients
        self.partition = partition
        self.alpha = alpha
        self.classes_per_client = classes_per_client
        self.size = image_size
        self.channels = channels
        self.site_styles = site_styles
        resolve_site_styles(site_styles, num_clients, seed, channels or 1)  # a bad style fails here, not at setup
        self.max_samples_per_client = max_samples_per_client
        self._declared_num_classes = num_classes
        self._source = str(self.path)

    def _read(self) -> tuple[Tensor, np.ndarray]:
        """Reads, checks and pools the three splits."""
        if not self.path.is_file():
            raise FileNotFoundError(f"MedMNIST file not found: {self.path}")
        # np.load takes any other file for a pickle and answers with advice to unpickle it: check the format first.
        if not zipfile.is_zipfile(self.path):
            raise ValueError(
                f"{self.path} is not a .npz archive (a zip of .npy arrays, as numpy.savez writes): expected the keys "
                f"{_KEYS}"
            )
        images: list[Tensor] = []
        labels: list[np.ndarray] = []
        try:
            archive = np.load(self.path, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile) as err:
            raise ValueError(f"{self.path} cannot be read as a .npz archive: {err}") from None
        with archive:
            if not archive.files:
                raise ValueError(
                    f"{self.path} is an empty .npz archive (it holds no arrays): expected the keys {_KEYS}"
                )
            for split in _SPLITS:
                split_images, split_labels = _read_split(archive, split, self.path)
                self._check_label_range(split_labels, split)
                x = _to_tensor(split_images)
                if self.size is not None:
                    # Resize per split so splits stored at different sizes can still be pooled.
                    x = resize_images(x, self.size)
                images.append(x)
                labels.append(split_labels)
        shapes = {tuple(x.shape[1:]) for x in images if len(x)}
        if len(shapes) > 1:
            raise ValueError(f"{self.path}: splits have different image shapes {sorted(shapes)}; set image_size")
        pooled = torch.cat(images)
        if not len(pooled):
            raise ValueError(f"{self.path} holds no images (every split of {_KEYS} is empty)")
        if self.channels is not None:
            pooled = convert_channels(pooled, self.channels)
        return pooled, np.concatenate(labels)

    def _check_label_range(self, labels: np.ndarray, split: str) -> None:
        """Checks labels against ``[0, num_classes)`` (or ``>= 0`` when the class count is inferred)."""
        high = self._declared_num_classes
        bad = labels[(labels < 0) | (labels >= high)] if high is not None else labels[labels < 0]
        if bad.size:
            bound = f"[0, {high})" if high is not None else ">= 0"
            raise ValueError(f"{self.path}: {split} split has label {int(bad[0])}, expected labels in {bound}")

    def _load(self) -> list[ClientSplit]:
        images, labels = self._read()
        check_clients_fit(
            len(labels), self.num_clients, self.test_fraction, str(self.path), self.max_samples_per_client
        )
        parts = partition(
            labels,
            self.partition,
            self.num_clients,
            stable_seed(self.seed, "partition"),
            alpha=self.alpha,
            classes_per_client=self.classes_per_client,
        )
        parts = subsample(parts, self.max_samples_per_client, self.seed)
        styles = style_index = None
        if self.site_styles:
            styles = resolve_site_styles(self.site_styles, self.num_clients, self.seed, int(images.shape[1]))
            style_index = np.empty(len(labels), dtype=np.int64)
            for client, idx in enumerate(parts):
                style_index[idx] = client
        client_ids = [f"client{i}" for i in range(self.num_clients)]
        return build_client_splits(
            images, labels, parts, client_ids, self.test_fraction, self.seed, styles=styles, style_index=style_index
        )
