"""Image folders per client: ``root/<client>/<class>/*.png`` (also .jpg/.jpeg/.bmp), for classification."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from datamodules.assemble import build_client_splits
from datamodules.base import ClientSplit, FederatedDataModule, check_image_args

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def _visible_dirs(directory: Path) -> list[Path]:
    # Hidden directories (.ipynb_checkpoints, .DS_Store folders, ...) are never clients or classes.
    return sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def load_image(path: Path, channels: int, size: int) -> np.ndarray:
    """Loads one image as uint8 (size, size, channels).

    Args:
        path: Image file.
        channels: 1 (converted to "L") or 3 (converted to "RGB").
        size: Target side; resized bilinearly if different.

    Returns:
        A uint8 array of shape (size, size, channels).

    Raises:
        ValueError: If the file cannot be read as an image, naming it.

    """
    try:
        with Image.open(path) as image:
            image = image.convert("L" if channels == 1 else "RGB")
            if image.size != (size, size):
                image = image.resize((size, size), Image.Resampling.BILINEAR)
            array = np.asarray(image, dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise ValueError(f"cannot read image {path}: {err}") from err
    return array.reshape(size, size, channels)


class ImageFolderFederated(FederatedDataModule):
    """One client per sub-directory of ``root``, one class per sub-sub-directory: ``root/<client>/<class>/*.png``.

    Client ids are the client directory names (sorted). Classes are ``classes`` if given (label = position in the
    list) or else the sorted union of all class directory names. Every client's images are split into train and
    test (stratified).

    A class directory without images is handled by whether another client has images of that class. If none has,
    the class would exist only because of the empty directories: when classes are taken from the directory names
    this is refused (it would silently add a phantom class to ``num_classes``) with an error naming every such client
    and directory; the fix is to delete them or to pass ``classes``, which declares the classes (an explicitly given
    class may have no images anywhere). If another client has images of the class, the empty directory does not
    change the classes (non-IID clients may legitimately lack a class) but may be a copy that went wrong, so a
    ``UserWarning`` names the client and the directory. A client with no directory at all for a class is silent.

    Args:
        root: The root directory.
        classes: Class names in label order (None: sorted union of the class directories found).
        image_size: Side to which every image is resized.
        channels: 1 (images converted to gray) or 3 (converted to RGB).
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's samples held out as its test set.
        val_fraction: Fraction of each client's training samples held out as its validation set
            (default 0: none; see :class:`~datamodules.base.FederatedDataModule`).
        seed: Seed for splitting and shuffling.

    Raises:
        ValueError: On an invalid argument, naming it. Data errors are raised when the data is first loaded.

    """

    def __init__(
        self,
        root: str | Path,
        *,
        classes: list[str] | None = None,
        image_size: int = 28,
        channels: int = 1,
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
        check_image_args(image_size, channels)
        if classes is not None and (not classes or len(set(classes)) != len(classes)):
            raise ValueError(f"classes must be a non-empty list of distinct names, got {classes}")
        self.root = Path(root)
        self.classes = list(classes) if classes is not None else None
        self.size = image_size
        self.channels = channels
        self._source = str(self.root)
        self._class_names: list[str] = []

    def _scan(self) -> tuple[list[Path], list[str]]:
        """Finds the client directories and the class names."""
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder root not found: {self.root}")
        client_dirs = _visible_dirs(self.root)
        if not client_dirs:
            raise ValueError(f"no client directories in {self.root}; expected root/<client>/<class>/*.png")
        class_dirs = [d for client in client_dirs for d in _visible_dirs(client)]
        empty = [d for d in class_dirs if not _image_files(d)]
        with_images = {d.name for d in class_dirs if d not in empty}
        classes = self.classes
        if classes is None:
            phantom = [d for d in empty if d.name not in with_images]
            if phantom:
                where = ", ".join(f"client {d.parent.name!r}: {d}" for d in phantom)
                raise ValueError(
                    f"class directories with no images in any client would add classes "
                    f"{sorted({d.name for d in phantom})} without a single sample ({where}); delete them, or pass "
                    f"classes=[...] to declare the classes explicitly"
                )
            classes = sorted({d.name for d in class_dirs})
        for d in empty:
            if d.name in with_images:
                warnings.warn(
                    f"client {d.parent.name!r}: class directory {d} has no images (other clients have images of "
                    f"class {d.name!r}); this client is treated as lacking that class",
                    stacklevel=2,
                )
        return client_dirs, classes

    def _load_client(self, client_dir: Path, class_index: dict[str, int]) -> tuple[torch.Tensor, np.ndarray]:
        stray = _image_files(client_dir)
        if stray:
            raise ValueError(
                f"client {client_dir.name!r}: image {stray[0]} is not inside a class directory; expected "
                f"{client_dir}/<class>/<image>"
            )
        arrays: list[np.ndarray] = []
        labels: list[int] = []
        for class_dir in _visible_dirs(client_dir):
            if class_dir.name not in class_index:
                raise ValueError(
                    f"client {client_dir.name!r}: class directory {class_dir} is not one of the classes "
                    f"{list(class_index)}"
                )
            for file in _image_files(class_dir):
                arrays.append(load_image(file, self.channels, self.size))
                labels.append(class_index[class_dir.name])
        if not arrays:
            raise ValueError(
                f"client {client_dir.name!r} has no images in {client_dir} (looked for "
                f"<class>/*{{{','.join(IMAGE_SUFFIXES)}}})"
            )
        x = torch.as_tensor(np.stack(arrays), dtype=torch.float32).permute(0, 3, 1, 2).contiguous() / 255.0
        return x, np.asarray(labels, dtype=np.int64)

    def _load(self) -> list[ClientSplit]:
        client_dirs, classes = self._scan()
        self._declared_num_classes = len(classes)
        self._class_names = classes
        class_index = {name: i for i, name in enumerate(classes)}
        splits: list[ClientSplit] = []
        for client_dir in client_dirs:
            x, y = self._load_client(client_dir, class_index)
            splits += build_client_splits(x, y, [np.arange(len(y))], [client_dir.name], self.test_fraction, self.seed)
        return splits

    def label_names(self) -> list[str]:
        """The class directories' names, in label order (:attr:`class_names`)."""
        return self.class_names

    @property
    def class_names(self) -> list[str]:
        """Class names in label order."""
        self._ensure_loaded()
        return list(self._class_names)
