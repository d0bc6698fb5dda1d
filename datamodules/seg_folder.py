"""Image/mask folder pairs per client for segmentation: ``root/<client>/images/*.png`` + ``.../masks/*.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from datamodules.base import ClientSplit, FederatedDataModule, check_image_args
from datamodules.image_folder import IMAGE_SUFFIXES, _image_files, _visible_dirs, load_image
from datamodules.sampler import stable_seed
from datamodules.split import split_train_test

MASK_SUFFIXES = (".png", ".bmp", ".tif", ".tiff")  # lossless only: a JPEG mask would invent class values


def load_mask(path: Path, size: int) -> np.ndarray:
    """Loads one single-channel mask as int64 (size, size), resized with nearest neighbour (no new values).

    Args:
        path: Mask file (8/16-bit gray or palette image; palette indices are the values).
        size: Target side.

    Returns:
        The raw pixel values.

    Raises:
        ValueError: If the file cannot be read or has several channels, naming it.

    """
    try:
        with Image.open(path) as image:
            if image.mode not in ("1", "L", "P", "I", "I;16", "I;16B", "I;16L"):
                raise ValueError(f"a mask must have one channel of class values, got mode {image.mode}")
            if image.size != (size, size):
                image = image.resize((size, size), Image.Resampling.NEAREST)
            return np.asarray(image).astype(np.int64)
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise ValueError(f"cannot read mask {path}: {err}") from err


def _pixel_size(path: Path) -> tuple[int, int] | None:
    """(width, height) from the file's header, or None if unreadable (the loaders then name the file)."""
    try:
        with Image.open(path) as image:
            return image.size
    except (OSError, UnidentifiedImageError, ValueError):
        return None


def check_pair_size(image: Path, mask: Path, client: str) -> None:
    """A mask must have its image's size: resizing one to fit the other would misplace every label.

    Raises:
        ValueError: Naming the client, both files and both sizes.
    """
    image_size, mask_size = _pixel_size(image), _pixel_size(mask)
    if image_size is not None and mask_size is not None and image_size != mask_size:
        raise ValueError(
            f"client {client!r}: mask {mask} is {mask_size[0]}x{mask_size[1]} but its image {image} is "
            f"{image_size[0]}x{image_size[1]}; a mask must have its image's size (width x height)"
        )


class SegFolderFederated(FederatedDataModule):
    """One client per sub-directory of ``root``, each with ``images/`` and ``masks/`` of matching file stems.

    ``root/<client>/images/case1.png`` pairs with ``root/<client>/masks/case1.png`` (any of
    .png/.bmp/.tif for masks; images may also be .jpg). Mask pixels are class ids (0 = background), or
    are mapped through ``mask_values`` (e.g. ``[0, 255]`` for binary masks saved as 0/255). Every client's
    pairs are split into train and test at random (seeded). Client ids are the directory names (sorted).

    Args:
        root: The root directory.
        num_classes: Classes including background (None: max mask value + 1 over all clients, or
            ``len(mask_values)``).
        mask_values: Pixel values in class order; a value not listed is an error naming the file.
        image_size: Side to which images (bilinear) and masks (nearest) are resized.
        channels: 1 (gray) or 3 (RGB).
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's pairs held out as its test set.
        seed: Seed for splitting and shuffling.

    Raises:
        ValueError: On an invalid argument, naming it. Data errors (missing directory, unpaired file,
            unreadable file, a mask whose size differs from its image's, mask value out of range) are raised at
            the first load and name the client and file.

    """

    def __init__(
        self,
        root: str | Path,
        *,
        num_classes: int | None = None,
        mask_values: list[int] | None = None,
        image_size: int = 64,
        channels: int = 1,
        batch_size: int = 16,
        eval_batch_size: int = 64,
        test_fraction: float = 0.2,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, test_fraction=test_fraction, seed=seed)
        check_image_args(image_size, channels)
        if mask_values is not None and (not mask_values or len(set(mask_values)) != len(mask_values)):
            raise ValueError(f"mask_values must be a non-empty list of distinct pixel values, got {mask_values}")
        if num_classes is not None and num_classes < 2:
            raise ValueError(f"num_classes must be >= 2 (background + a class), got {num_classes}")
        if num_classes is not None and mask_values is not None and num_classes != len(mask_values):
            raise ValueError(f"num_classes={num_classes} but mask_values lists {len(mask_values)} values")
        self.root = Path(root)
        self.mask_values = list(mask_values) if mask_values is not None else None
        self.size = image_size
        self.channels = channels
        self._declared_num_classes = num_classes if num_classes is not None else (
            len(mask_values) if mask_values is not None else None
        )  # fmt: skip
        self._source = str(self.root)

    def _pairs(self, client_dir: Path) -> list[tuple[Path, Path]]:
        """(image, mask) files of one client, matched by stem; any unmatched file is an error naming it."""
        images_dir, masks_dir = client_dir / "images", client_dir / "masks"
        for d in (images_dir, masks_dir):
            if not d.is_dir():
                raise ValueError(f"client {client_dir.name!r}: missing directory {d} (expected images/ and masks/)")
        images = {p.stem: p for p in _image_files(images_dir)}
        masks = {p.stem: p for p in sorted(masks_dir.iterdir()) if p.is_file() and p.suffix.lower() in MASK_SUFFIXES}
        if not images:
            raise ValueError(f"client {client_dir.name!r} has no images in {images_dir} (looked for {IMAGE_SUFFIXES})")
        unpaired_images, unpaired_masks = sorted(images.keys() - masks.keys()), sorted(masks.keys() - images.keys())
        if unpaired_images:
            stem = unpaired_images[0]
            raise ValueError(f"client {client_dir.name!r}: image {images[stem]} has no mask {masks_dir}/{stem}.png")
        if unpaired_masks:
            raise ValueError(
                f"client {client_dir.name!r}: mask {masks[unpaired_masks[0]]} has no image in {images_dir}"
            )
        return [(images[s], masks[s]) for s in sorted(images)]

    def _mask_classes(self, raw: np.ndarray, path: Path, client: str) -> np.ndarray:
        """Maps raw mask values to class ids; a value outside the classes is an error naming the file."""
        if self.mask_values is not None:
            lookup = {v: i for i, v in enumerate(self.mask_values)}
            unknown = sorted(set(np.unique(raw).tolist()) - lookup.keys())
            if unknown:
                raise ValueError(
                    f"client {client!r}: mask {path} has value {unknown[0]} not in mask_values {self.mask_values}"
                )
            return np.vectorize(lookup.__getitem__, otypes=[np.int64])(raw) if raw.size else raw
        limit = self._declared_num_classes
        if raw.min() < 0 or (limit is not None and raw.max() >= limit):
            bad = int(raw.max()) if raw.max() >= (limit or 0) else int(raw.min())
            raise ValueError(f"client {client!r}: mask {path} has value {bad} outside the classes [0, {limit})")
        return raw

    def _load(self) -> list[ClientSplit]:
        if not self.root.is_dir():
            raise FileNotFoundError(f"segmentation folder root not found: {self.root}")
        client_dirs = _visible_dirs(self.root)
        if not client_dirs:
            raise ValueError(f"no client directories in {self.root}; expected root/<client>/images and masks")
        splits = []
        for client_dir in client_dirs:
            pairs = self._pairs(client_dir)
            for image, mask in pairs:
                check_pair_size(image, mask, client_dir.name)
            x = np.stack([load_image(img, self.channels, self.size) for img, _ in pairs])
            y = np.stack([self._mask_classes(load_mask(m, self.size), m, client_dir.name) for _, m in pairs])
            idx = np.arange(len(pairs))
            seed = stable_seed(self.seed, "split", client_dir.name)
            train, test = split_train_test(idx, np.zeros(len(idx), dtype=np.int64), self.test_fraction, seed)
            images = torch.as_tensor(x, dtype=torch.float32).permute(0, 3, 1, 2).contiguous() / 255.0
            masks = torch.as_tensor(y, dtype=torch.int64)
            splits.append(
                ClientSplit(
                    client_dir.name, images[train].contiguous(), masks[train], images[test].contiguous(), masks[test]
                )
            )
        return splits
