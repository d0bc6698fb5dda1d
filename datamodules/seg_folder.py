"""Image/mask folder pairs per client for segmentation: ``root/<client>/images/*.png`` + ``.../masks/*.png``.

A client's train/test split is random (seeded) by default, or given by ``root/<client>/train/`` and ``test/``
sub-folders, or by a split file.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from datamodules.base import ClientSplit, FederatedDataModule, check_image_args
from datamodules.image_folder import IMAGE_SUFFIXES, _image_files, _visible_dirs, load_image
from datamodules.sampler import stable_seed
from datamodules.split import split_train_test

MASK_SUFFIXES = (".png", ".bmp", ".tif", ".tiff")  # lossless only: a JPEG mask would invent class values
SPLITS = ("train", "test")
VAL = "val"  # an optional official validation split: a val/ sub-folder, or split file lines saying val

log = logging.getLogger(__name__)

Pair = tuple[Path, Path]


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


def read_split_file(path: Path) -> list[tuple[int, str, Path, str]]:
    """Reads a split file: one ``client,image,split`` or ``image,split`` line per image.

    Fields are separated by commas (CSV, quotes allowed), else by a tab, else by white space. Blank lines and lines
    starting with ``#`` are skipped; a first line ``client,image,split`` or ``image,split`` is a header. In
    ``client,image,split`` the image path is relative to ``root/<client>/`` (``images/case1.png``,
    ``test/images/case1.png``); in ``image,split`` it is relative to ``root`` and starts with the client folder
    (``hospA/images/case1.png``). ``split`` is ``train``, ``test`` or ``val`` (any case; ``val``: the client's
    official validation set).

    Args:
        path: The split file.

    Returns:
        ``(line number, client, image path relative to the client folder, split)`` per listed image, in file order.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: Naming the file and the line: a line without 2 or 3 fields, an empty field, an ``image,split``
            path without a client folder, or a split other than train/test/val; or if the file lists no image.
    """
    if not path.is_file():
        raise FileNotFoundError(f"split file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a spreadsheet's byte-order mark is not part of a path
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read split file {path}: {err}") from err
    rows: list[tuple[int, str, Path, str]] = []
    first = True
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "," in line:
            fields = next(csv.reader([line]))
        elif "\t" in line:
            fields = line.split("\t")
        else:
            fields = line.split()
        fields = [f.strip() for f in fields]
        if first and [f.lower() for f in fields] in (["client", "image", "split"], ["image", "split"]):
            first = False
            continue
        first = False
        where = f"split file {path} line {number}"
        if len(fields) not in (2, 3):
            raise ValueError(
                f"{where}: expected client,image,split or image,split, got {len(fields)} field(s): {line!r}"
            )
        if not all(fields):
            raise ValueError(f"{where}: empty field in {line!r}")
        *head, image, split = fields
        if split.lower() not in (*SPLITS, VAL):
            raise ValueError(f"{where}: split must be 'train', 'test' or 'val', got {split!r}")
        relative = Path(image)
        if head:
            client = head[0]
        else:
            if relative.is_absolute() or len(relative.parts) < 2:
                raise ValueError(
                    f"{where}: in the image,split form the image path is relative to the root and starts with its "
                    f"client folder (hospA/images/case1.png), got {image!r}"
                )
            client, relative = relative.parts[0], Path(*relative.parts[1:])
        rows.append((number, client, relative, split.lower()))
    if not rows:
        raise ValueError(f"split file {path} lists no images")
    return rows


class SegFolderFederated(FederatedDataModule):
    """One client per sub-directory of ``root``, each with ``images/`` and ``masks/`` of matching file stems.

    ``root/<client>/images/case1.png`` pairs with ``root/<client>/masks/case1.png`` (any of
    .png/.bmp/.tif for masks; images may also be .jpg). Mask pixels are class ids (0 = background), or
    are mapped through ``mask_values`` (e.g. ``[0, 255]`` for binary masks saved as 0/255). Client ids are the
    directory names (sorted).

    The train/test split of a client is, in this order of precedence:

    - given by ``split_file`` (see :func:`read_split_file` for its format). A client's images are then those of
      its ``images/`` folder and of its ``train/images/`` and ``test/images/`` folders, whichever exist; the file
      decides each image's split whatever folder it is in. The file is strict: every client folder must be listed,
      every listed image must exist and be one of its client's paired images, every image of a client must be
      listed (an unlisted image is an error, not a silent drop), no image may be listed twice, and every client
      needs at least one train and one test image. Each split keeps the file's order.
    - given by the folders: when a client holds ``train/`` and ``test/`` sub-folders, each with the
      ``images/`` + ``masks/`` layout above (``root/<client>/test/images/case1.png`` + ``.../test/masks/case1.png``),
      they are its training and test sets, each in file-stem order. Every client must then have them: a mix of
      clients with and without sub-folders is an error naming both groups (pass ``split_file`` to mix layouts).
      A ``val/`` sub-folder beside them (same layout) is the client's official validation set.
    - otherwise random: each client's pairs are split at random (seeded by ``seed`` and the client id), a
      ``test_fraction`` of them held out.

    With a given split (file or folders) no pair is moved and ``test_fraction`` is ignored (logged at INFO). Official
    validation images (``val/`` folders, ``val`` lines) are each client's validation set; ``val_fraction`` must then
    stay 0 (else it carves one out of the training images).
    Image/mask pairing is checked in every folder as it is for the random split.

    Args:
        root: The root directory.
        num_classes: Classes including background (None: max mask value + 1 over all clients, or
            ``len(mask_values)``).
        mask_values: Pixel values in class order; a value not listed is an error naming the file.
        image_size: Side to which images (bilinear) and masks (nearest) are resized.
        channels: 1 (gray) or 3 (RGB).
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's pairs held out as its test set (random split only; ignored with
            ``train/``/``test/`` sub-folders or a ``split_file``).
        val_fraction: Fraction of each client's training samples held out as its validation set
            (default 0: none; see :class:`~datamodules.base.FederatedDataModule`).
        seed: Seed for splitting and shuffling.
        split_file: Optional CSV or text file giving every image's split, one ``client,image,split`` line
            (image relative to ``root/<client>/``) or ``image,split`` line (image relative to ``root``) per image,
            split ``train`` or ``test``; it overrides sub-folders and the random split. None: sub-folders if the
            clients have them, else the random split.

    Raises:
        ValueError: On an invalid argument, naming it. Data errors (missing directory, unpaired file,
            unreadable file, a mask whose size differs from its image's, mask value out of range, a client with
            ``train/`` but no ``test/`` sub-folder or mixed layouts, a bad split file line naming the file and the
            line, a client without a train or test image) are raised at the first load and name the client and file.
        FileNotFoundError: At the first load, if ``root``, ``split_file`` or an image the split file lists is
            missing (naming the file and the line).

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
        val_fraction: float = 0.0,
        seed: int = 0,
        split_file: str | Path | None = None,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            test_fraction=test_fraction,
            seed=seed,
            val_fraction=val_fraction,
        )
        check_image_args(image_size, channels)
        if mask_values is not None and (not mask_values or len(set(mask_values)) != len(mask_values)):
            raise ValueError(f"mask_values must be a non-empty list of distinct pixel values, got {mask_values}")
        if num_classes is not None and num_classes < 2:
            raise ValueError(f"num_classes must be >= 2 (background + a class), got {num_classes}")
        if num_classes is not None and mask_values is not None and num_classes != len(mask_values):
            raise ValueError(f"num_classes={num_classes} but mask_values lists {len(mask_values)} values")
        self.root = Path(root)
        self.split_file = Path(split_file) if split_file is not None else None
        self.mask_values = list(mask_values) if mask_values is not None else None
        self.size = image_size
        self.channels = channels
        self._declared_num_classes = num_classes if num_classes is not None else (
            len(mask_values) if mask_values is not None else None
        )  # fmt: skip
        self._source = str(self.root)

    def _pairs(self, folder: Path, client: str | None = None) -> list[Pair]:
        """(image, mask) files of ``folder/images`` and ``folder/masks``, matched by stem, in stem order.

        ``folder`` is a client folder or its ``train/`` or ``test/`` sub-folder; ``client`` (default: the folder's
        name) names the client in errors. Any unmatched file is an error naming it.
        """
        client = folder.name if client is None else client
        images_dir, masks_dir = folder / "images", folder / "masks"
        for d in (images_dir, masks_dir):
            if not d.is_dir():
                raise ValueError(f"client {client!r}: missing directory {d} (expected images/ and masks/)")
        images = {p.stem: p for p in _image_files(images_dir)}
        masks = {p.stem: p for p in sorted(masks_dir.iterdir()) if p.is_file() and p.suffix.lower() in MASK_SUFFIXES}
        if not images:
            raise ValueError(f"client {client!r} has no images in {images_dir} (looked for {IMAGE_SUFFIXES})")
        unpaired_images, unpaired_masks = sorted(images.keys() - masks.keys()), sorted(masks.keys() - images.keys())
        if unpaired_images:
            stem = unpaired_images[0]
            raise ValueError(f"client {client!r}: image {images[stem]} has no mask {masks_dir}/{stem}.png")
        if unpaired_masks:
            raise ValueError(f"client {client!r}: mask {masks[unpaired_masks[0]]} has no image in {images_dir}")
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

    def _has_split_folders(self, client_dir: Path) -> bool:
        """Whether a client holds ``train/`` and ``test/`` sub-folders (a given split) rather than images/ + masks/.

        Raises:
            ValueError: Naming the client: one of ``train/`` and ``test/`` without the other, or both layouts.
        """
        present = [s for s in SPLITS if (client_dir / s).is_dir()]
        if not present:
            return False
        if len(present) == 1:
            other = "test" if present[0] == "train" else "train"
            raise ValueError(
                f"client {client_dir.name!r}: {client_dir / present[0]} has no {other}/ sibling; a given split needs "
                f"both train/ and test/ sub-folders, each with images/ and masks/"
            )
        flat = [d for d in ("images", "masks") if (client_dir / d).is_dir()]
        if flat:
            raise ValueError(
                f"client {client_dir.name!r} holds train/ and test/ sub-folders and also {client_dir / flat[0]}; keep "
                f"one layout: images/ + masks/ (random split) or train/ + test/ (given split)"
            )
        return True

    def _given_splits(self, client_dirs: list[Path]) -> dict[str, tuple[list[Pair], list[Pair], list[Pair]]] | None:
        """Every client's (train, test, val pairs) from ``split_file`` or the sub-folders; None: random split.

        The val pairs are empty where the client has no official validation images.
        """
        if self.split_file is not None:
            log.info("%s: train/test split given by %s; test_fraction is ignored", self.root, self.split_file)
            return self._file_splits(client_dirs, self.split_file)
        layouts = {d.name: self._has_split_folders(d) for d in client_dirs}
        if not any(layouts.values()):
            return None
        if not all(layouts.values()):
            with_split = ", ".join(repr(c) for c, split in layouts.items() if split)
            without = ", ".join(repr(c) for c, split in layouts.items() if not split)
            raise ValueError(
                f"{self.root}: mixed layouts: client(s) {with_split} have train/ and test/ sub-folders (a given "
                f"split) but client(s) {without} do not (a random split); give every client the same layout, or "
                f"pass split_file to list every image's split"
            )
        log.info(
            "%s: train/test split given by the clients' train/ and test/ sub-folders; test_fraction is ignored",
            self.root,
        )
        return {
            d.name: (
                self._pairs(d / "train", d.name),
                self._pairs(d / "test", d.name),
                self._pairs(d / VAL, d.name) if (d / VAL).is_dir() else [],
            )
            for d in client_dirs
        }

    def _file_splits(self, client_dirs: list[Path], path: Path) -> dict[str, tuple[list[Pair], list[Pair], list[Pair]]]:
        """Every client's (train, test, val pairs) as the split file ``path`` lists them, in file order (strict)."""
        rows = read_split_file(path)
        dirs = {d.name: d for d in client_dirs}
        listed: dict[str, dict[Path, tuple[int, Path, str]]] = {}
        seen: dict[Path, int] = {}
        for number, client, relative, split in rows:
            where = f"split file {path} line {number}"
            if client not in dirs:
                raise ValueError(
                    f"{where}: client {client!r} has no folder in {self.root} (clients: {', '.join(dirs)})"
                )
            file = dirs[client] / relative
            if not file.is_file():
                raise FileNotFoundError(f"{where}: image {file} not found")
            key = file.resolve()
            if key in seen:
                raise ValueError(f"{where}: image {file} is already listed on line {seen[key]}")
            seen[key] = number
            listed.setdefault(client, {})[key] = (number, file, split)
        unlisted = [c for c in dirs if c not in listed]
        if unlisted:
            raise ValueError(
                f"split file {path} lists no image of client(s) {', '.join(map(repr, unlisted))}; every client "
                f"folder of {self.root} must be listed"
            )
        out = {}
        for client, client_dir in dirs.items():
            folders = [f for f in (client_dir / "train", client_dir / "test", client_dir / VAL) if f.is_dir()]
            if (client_dir / "images").is_dir() or (client_dir / "masks").is_dir() or not folders:
                folders.insert(0, client_dir)  # without any layout, _pairs names the missing images/ directory
            pairs = {image.resolve(): (image, mask) for f in folders for image, mask in self._pairs(f, client)}
            for key, (number, file, _) in listed[client].items():
                if key not in pairs:
                    looked = ", ".join(str(f / "images") for f in folders)
                    raise ValueError(
                        f"split file {path} line {number}: {file} is not an image of client {client!r} (its images "
                        f"are read from {looked})"
                    )
            missing = [image for key, (image, _) in pairs.items() if key not in listed[client]]
            if missing:
                raise ValueError(
                    f"split file {path} does not list image {missing[0]} of client {client!r} ({len(missing)} "
                    f"unlisted); every image of a client must be listed"
                )
            split = {s: [pairs[k] for k, (_, _, given) in listed[client].items() if given == s] for s in (*SPLITS, VAL)}
            for s in SPLITS:
                if not split[s]:
                    raise ValueError(f"split file {path} gives client {client!r} no {s} image")
            out[client] = (split["train"], split["test"], split[VAL])
        return out

    def _load(self) -> list[ClientSplit]:
        if not self.root.is_dir():
            raise FileNotFoundError(f"segmentation folder root not found: {self.root}")
        client_dirs = _visible_dirs(self.root)
        if not client_dirs:
            raise ValueError(f"no client directories in {self.root}; expected root/<client>/images and masks")
        given = self._given_splits(client_dirs)
        official = [c for c, (_, _, val) in (given or {}).items() if val]
        if official and self.val_fraction > 0:
            raise ValueError(
                f"{self.root}: client(s) {', '.join(map(repr, official))} have official validation images (val/ or "
                f"split 'val') and val_fraction={self.val_fraction} would carve another validation set: keep one "
                "(val_fraction: 0 to use the official images)"
            )
        splits = []
        for client_dir in client_dirs:
            if given is None:
                pairs = self._pairs(client_dir)
                idx = np.arange(len(pairs))
                seed = stable_seed(self.seed, "split", client_dir.name)
                train, test = split_train_test(idx, np.zeros(len(idx), dtype=np.int64), self.test_fraction, seed)
            else:
                train_pairs, test_pairs, val_pairs = given[client_dir.name]
                pairs = train_pairs + test_pairs + val_pairs
                train, test = (
                    np.arange(len(train_pairs)),
                    np.arange(len(train_pairs), len(train_pairs) + len(test_pairs)),
                )
                val = np.arange(len(train_pairs) + len(test_pairs), len(pairs))
            for image, mask in pairs:
                check_pair_size(image, mask, client_dir.name)
            x = np.stack([load_image(img, self.channels, self.size) for img, _ in pairs])
            y = np.stack([self._mask_classes(load_mask(m, self.size), m, client_dir.name) for _, m in pairs])
            images = torch.as_tensor(x, dtype=torch.float32).permute(0, 3, 1, 2).contiguous() / 255.0
            masks = torch.as_tensor(y, dtype=torch.int64)
            split = ClientSplit(
                client_dir.name, images[train].contiguous(), masks[train], images[test].contiguous(), masks[test]
            )
            if official:  # every client's official validation set (empty for one without: no carving then)
                at = torch.as_tensor(val)
                split = dataclasses.replace(split, val_x=images[at].contiguous(), val_y=masks[at])
            splits.append(split)
        return splits
