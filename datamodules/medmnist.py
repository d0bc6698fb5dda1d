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
from datamodules.site_table import site_clients

_SPLITS = ("train", "val", "test")
_KEYS = "{train,val,test}_{images,labels}"
# MedMNIST files carry no site/domain ids, so only label-based schemes apply.
_SCHEMES = ("iid", "dirichlet", "pathological")
# The synthetic partition's options and their defaults: with ``site_key`` the file's sites are the clients, so a
# changed value would do nothing (partition, alpha and classes_per_client still split a site over its clients).
_PARTITION_DEFAULTS = {"num_clients": 5, "site_styles": False}
_WITHIN_SITE_DEFAULTS = {"partition": "iid", "alpha": 0.5, "classes_per_client": 2}
_WITHIN_SITE_HINT = " (partition, alpha and classes_per_client split a site only with clients_per_site > 1)"


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


def _read_sites(archive: np.lib.npyio.NpzFile, split: str, site_key: str, n: int, path: Path) -> np.ndarray:
    """Reads and checks ``<split>_<site_key>``: one site id (integer or text) per image of the split."""
    key = f"{split}_{site_key}"
    if key not in archive.files:
        if n == 0:
            return np.empty(0, dtype=np.int64)
        raise KeyError(
            f"key {key!r} (site_key={site_key!r}: the site of each of the {n} {split} images) missing from {path} "
            f"(keys present: {', '.join(sorted(archive.files))})"
        )
    try:
        sites = archive[key]
    except ValueError as err:  # object arrays: numpy's message advises unsafe loading, not ours to give
        raise ValueError(
            f"{path}: array {key!r} cannot be read as a plain array (it holds Python objects or is damaged): "
            f"{type(err).__name__}; store integer or string site ids"
        ) from None
    if sites.ndim == 2 and sites.shape[1] == 1:
        sites = sites.reshape(-1)
    if sites.ndim != 1 or len(sites) != n:
        raise ValueError(f"{path}: {key} must hold one site id per {split} image, shape ({n},), got {sites.shape}")
    if sites.dtype.kind == "S":
        sites = sites.astype(str)
    if sites.dtype.kind not in "iuU":
        raise ValueError(f"{path}: {key} must hold integer or string site ids, got dtype {sites.dtype}")
    return sites


def _site_names(sites: list[np.ndarray], site_key: str, path: Path) -> tuple[np.ndarray, list[str]]:
    """Each image's site index and the site names in client order (``site<v>`` for integers, else the text)."""
    kinds = {"integer" if s.dtype.kind in "iu" else "string" for s in sites if len(s)}
    if len(kinds) > 1:
        raise ValueError(f"{path}: the *_{site_key} arrays mix integer and string site ids; use one kind")
    if kinds == {"string"}:
        values = np.concatenate([s.astype(str) for s in sites])
        names = [str(v) for v in np.unique(values)]
        empty = [n for n in names if not n.strip()]
        if empty:
            raise ValueError(f"{path}: the *_{site_key} arrays hold an empty site id")
    else:
        values = np.concatenate([s.astype(np.int64) for s in sites])
        names = [f"site{int(v)}" for v in np.unique(values)]
    _, index = np.unique(values, return_inverse=True)
    return index.astype(np.int64).reshape(-1), names


def _to_tensor(images: np.ndarray) -> Tensor:
    """uint8 (N, H, W[, 3]) -> float32 (N, C, H, W) in [0, 1]."""
    x = torch.as_tensor(images, dtype=torch.float32) / 255.0
    return x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2).contiguous()


class MedMNISTFederated(FederatedDataModule):
    """A MedMNIST-format ``.npz`` (train/val/test images and labels) pooled and split over clients.

    All three splits are pooled, partitioned over ``num_clients`` clients (ids ``"client0"``, ...), optionally
    styled per client, and split per client into train and test (stratified).

    With ``site_key`` the file says which site (hospital) each image comes from, in the arrays
    ``<split>_<site_key>`` (e.g. ``train_site``, ``val_site``, ``test_site``; integers or strings, one per image),
    and each site is a client: integer sites ``v`` give client ids ``"site<v>"`` (``3`` -> ``"site3"``), string
    sites their own text, in sorted order. The pooled images of a site are then split into train and test as
    above, each image's site index is its ``train_domain``/``test_domain``, and ``clients_per_site`` > 1 splits a
    site over clients ``"<site>_0"``, ... by ``partition``. The synthetic partition's options
    (``num_clients``, ``site_styles``; ``partition``, ``alpha`` and ``classes_per_client`` unless
    ``clients_per_site`` > 1) must then keep their defaults: a changed value is refused, naming it.

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
        site_key: Name of the per-image site arrays ``<split>_<site_key>`` in the file; each site becomes a client
            (None: the synthetic partition over ``num_clients`` clients).
        clients_per_site: With ``site_key``, clients each site is split into by ``partition`` (1: one per site).
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's samples held out as its test set.
        val_fraction: Fraction of each client's training samples held out as its validation set
            (default 0: none; see :class:`~datamodules.base.FederatedDataModule`).
        seed: Seed for partitioning, styling, splitting and shuffling.

    Raises:
        ValueError: On an invalid argument, naming it. Data errors (missing file or key, multi-label file, label
            out of range, missing site arrays) are raised when the data is first loaded.

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
        site_key: str | None = None,
        clients_per_site: int = 1,
        batch_size: int = 32,
        eval_batch_size: int = 256,
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
        if clients_per_site < 1:
            raise ValueError(f"clients_per_site must be >= 1, got {clients_per_site}")
        if site_key is None and clients_per_site != 1:
            raise ValueError(f"clients_per_site={clients_per_site} needs site_key (the file's per-image sites)")
        if site_key is not None:
            _check_site_options(
                site_key,
                clients_per_site,
                num_clients=num_clients,
                site_styles=site_styles,
                partition=partition,
                alpha=alpha,
                classes_per_client=classes_per_client,
            )
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
        self.site_key = site_key
        self.clients_per_site = clients_per_site
        self._site_index: np.ndarray | None = None
        self._site_names: list[str] = []
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
        sites: list[np.ndarray] = []
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
                if self.site_key is not None:
                    sites.append(_read_sites(archive, split, self.site_key, len(split_labels), self.path))
        shapes = {tuple(x.shape[1:]) for x in images if len(x)}
        if len(shapes) > 1:
            raise ValueError(f"{self.path}: splits have different image shapes {sorted(shapes)}; set image_size")
        pooled = torch.cat(images)
        if not len(pooled):
            raise ValueError(f"{self.path} holds no images (every split of {_KEYS} is empty)")
        if self.channels is not None:
            pooled = convert_channels(pooled, self.channels)
        if self.site_key is not None:
            self._site_index, self._site_names = _site_names(sites, self.site_key, self.path)
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
        if self.site_key is not None:
            return self._load_sites(images, labels)
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

    def _load_sites(self, images: Tensor, labels: np.ndarray) -> list[ClientSplit]:
        """One client per site of ``<split>_<site_key>`` (or ``clients_per_site`` per site)."""
        site_index, names = self._site_index, self._site_names
        for s, name in enumerate(names):
            check_clients_fit(
                int((site_index == s).sum()),
                self.clients_per_site,
                self.test_fraction,
                f"{self.path}: site {name!r} ({self.site_key})",
                self.max_samples_per_client,
            )
        parts, client_ids = site_clients(
            site_index,
            labels,
            names,
            self.clients_per_site,
            self.partition,
            self.seed,
            alpha=self.alpha,
            classes_per_client=self.classes_per_client,
            source=str(self.path),
        )
        parts = subsample(parts, self.max_samples_per_client, self.seed)
        return build_client_splits(
            images, labels, parts, client_ids, self.test_fraction, self.seed, style_index=site_index
        )

    @property
    def site_names(self) -> list[str]:
        """With ``site_key``, the sites in client order (index = the images' ``train_domain``); else empty."""
        self._ensure_loaded()
        return list(self._site_names)

    def image_sources(self, client_id: str) -> tuple[list[str], str] | None:
        """Where each of the client's training images comes from: its site with ``site_key``, else as the base.

        Args:
            client_id: One of :attr:`client_ids`.

        Returns:
            ``(a name per training image, "sites" | "styles" | "domains")``, or None if the data describe neither.

        Raises:
            KeyError: If ``client_id`` is not one of :attr:`client_ids`.
        """
        if self.site_key is None:
            return super().image_sources(client_id)
        domains = self.client_data(client_id).train_domain
        return [self._site_names[d] for d in domains.tolist()], "sites"


def _check_site_options(site_key: str, clients_per_site: int, **values: object) -> None:
    """Refuses the synthetic partition's options when the file's sites are the clients, naming each changed one."""
    if not site_key or not site_key.strip():
        raise ValueError(f"site_key must name the site arrays (e.g. 'site' for train_site), got {site_key!r}")
    defaults = dict(_PARTITION_DEFAULTS)
    if clients_per_site == 1:
        defaults.update(_WITHIN_SITE_DEFAULTS)
    changed = [name for name, default in defaults.items() if values[name] != default]
    if changed:
        got = ", ".join(f"{name}={values[name]!r}" for name in changed)
        keep = ", ".join(f"{name}={defaults[name]!r}" for name in changed)
        within = "" if clients_per_site > 1 else _WITHIN_SITE_HINT
        raise ValueError(
            f"site_key={site_key!r}: the clients are the file's sites, so {got} would have no effect; leave the "
            f"default{'s' if len(changed) > 1 else ''} ({keep}){within}"
        )
