"""One NIfTI volume pair as 2D training data: read, check, slice, normalise, resize, map the labels (pure functions)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

SliceMode = Literal["foreground", "all"]
NormalizeMode = Literal["minmax", "zscore", "percentile"]
NORMALIZE_MODES = ("minmax", "zscore", "percentile")
_AFFINE_ATOL = 1e-3
_ZSCORE_CLIP = 3.0  # z-scores are clipped to [-3, 3] and mapped linearly onto [0, 1]
_PERCENTILES = (0.5, 99.5)


def select_slices(label: np.ndarray, axis: int, slices: SliceMode = "foreground", every_k: int = 1) -> np.ndarray:
    """Indices along ``axis`` of the slices to keep.

    Args:
        label: The label volume of class ids (0 = background), 3D.
        axis: The slicing axis (0, 1 or 2).
        slices: ``"foreground"`` keeps the slices whose label has a non-zero class; ``"all"`` keeps every slice.
        every_k: Then keeps every k-th of those, starting with the first.

    Returns:
        Sorted int64 slice indices.
    """
    if slices == "all":
        kept = np.arange(label.shape[axis])
    else:
        other = tuple(a for a in range(label.ndim) if a != axis)
        kept = np.flatnonzero(np.any(label != 0, axis=other))
    return kept[::every_k].astype(np.int64)


def normalize_volume(volume: np.ndarray, method: NormalizeMode) -> np.ndarray:
    """Maps one volume's intensities onto [0, 1], from statistics of the whole volume (not per slice).

    - ``"minmax"``: ``(x - min) / (max - min)``.
    - ``"zscore"``: ``z = (x - mean) / std``, clipped to [-3, 3], then ``(z + 3) / 6`` (the mean maps to 0.5).
    - ``"percentile"``: clipped to the 0.5th and 99.5th percentiles ``[p_lo, p_hi]``, then
      ``(x - p_lo) / (p_hi - p_lo)``: robust to a few extreme voxels.

    A constant volume (zero range or zero std) maps to 0 (``minmax``, ``percentile``) or 0.5 (``zscore``).

    Args:
        volume: The image volume (any shape), finite.
        method: One of ``"minmax"``, ``"zscore"``, ``"percentile"``.

    Returns:
        float32 array of the volume's shape, in [0, 1].

    Raises:
        ValueError: If ``method`` is unknown.
    """
    v = volume.astype(np.float64)
    if method == "zscore":
        std = float(v.std())
        z = (v - v.mean()) / std if std > 0 else np.zeros_like(v)
        out = (np.clip(z, -_ZSCORE_CLIP, _ZSCORE_CLIP) + _ZSCORE_CLIP) / (2 * _ZSCORE_CLIP)
    elif method in ("minmax", "percentile"):
        if method == "minmax":
            lo, hi = float(v.min()), float(v.max())
        else:
            lo, hi = (float(p) for p in np.percentile(v, _PERCENTILES))
            v = np.clip(v, lo, hi)
        out = (v - lo) / (hi - lo) if hi > lo else np.zeros_like(v)
    else:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE_MODES)}, got {method!r}")
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def take_slices(volume: np.ndarray, axis: int, indices: np.ndarray) -> np.ndarray:
    """The 2D slices ``indices`` along ``axis``, stacked first: (len(indices), H, W), the other axes in order."""
    return np.moveaxis(np.take(volume, indices, axis=axis), axis, 0)


def resize_slices(images: Tensor, labels: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Resizes slices to ``size`` x ``size``: images bilinearly, labels by nearest neighbour (no new class ids).

    Labels use ``nearest-exact``, which samples the pixel centres the bilinear image grid uses
    (``align_corners=False``), so masks stay aligned with their images.

    Args:
        images: float32 (N, H, W).
        labels: int64 (N, H, W).
        size: Target side.

    Returns:
        ``(float32 (N, 1, size, size), int64 (N, size, size))``.
    """
    x, y = images.unsqueeze(1), labels.unsqueeze(1)
    if tuple(x.shape[2:]) != (size, size) and len(x):
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
        y = F.interpolate(y.to(torch.float32), size=(size, size), mode="nearest-exact").round().to(torch.int64)
    return x.contiguous(), y[:, 0].contiguous()


def map_labels(raw: np.ndarray, num_classes: int, label_map: Mapping[int, int] | None, path: Path) -> np.ndarray:
    """Class ids from a label volume's raw values: through ``label_map``, or as they are.

    Args:
        raw: The label volume as read (float).
        num_classes: Classes including background.
        label_map: Raw value -> class; every value in the volume must be a key. None: values must be class ids.
        path: The label file, for the messages.

    Returns:
        int64 array of ``raw``'s shape, in ``[0, num_classes)``.

    Raises:
        ValueError: Naming the file and the value: a non-integer value, a value not in ``label_map``, or a
            value outside ``[0, num_classes)``.
    """
    values = np.unique(raw)
    fractional = values[values != np.round(values)]
    if fractional.size:
        raise ValueError(f"label {path} has non-integer value {float(fractional[0])}; labels must be class ids")
    if label_map is not None:
        unknown = [int(v) for v in values if int(v) not in label_map]
        if unknown:
            raise ValueError(
                f"label {path} has value {unknown[0]} not in label_map (keys {sorted(label_map)}); map every value"
            )
        classes = np.array([label_map[int(v)] for v in values], dtype=np.int64)
        return classes[np.searchsorted(values, raw)]
    bad = values[(values < 0) | (values >= num_classes)]
    if bad.size:
        raise ValueError(
            f"label {path} has value {int(bad[0])} outside the classes [0, {num_classes}); set num_classes or label_map"
        )
    return raw.astype(np.int64)


# ------------------------------------------------------------------------------------------------- reading


#: The most voxels a volume may claim (2**29, 2 GiB as float32; a 512 x 512 x 1000 CT holds 2**28): a header is
#: bytes from a file, checked before any voxel is allocated.
MAX_VOXELS = 1 << 29


def check_claimed_size(path: Path, shape: tuple[int, ...], itemsize: int, offset: int) -> None:
    """Refuse a header that claims more voxels than :data:`MAX_VOXELS` or, uncompressed, more bytes than the file has.

    Raises:
        ValueError: Naming the file, the claimed shape and what it would take.
    """
    voxels = math.prod(shape) if shape else 0
    if voxels > MAX_VOXELS:
        raise ValueError(
            f"{path}: its header claims shape {shape} ({voxels:,} voxels, {4 * voxels / 2**30:.1f} GiB as float32), "
            f"above the limit of {MAX_VOXELS:,} voxels: a corrupt header, or a volume to crop or resample first"
        )
    needed, size = offset + voxels * itemsize, Path(path).stat().st_size
    if not str(path).endswith(".gz") and needed > size:
        raise ValueError(
            f"{path}: its header claims shape {shape} ({needed:,} bytes with the header), but the file has "
            f"{size:,} bytes: truncated or corrupt"
        )


def read_volume(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Reads one NIfTI volume with nibabel: float32 voxels (3D) and the 4x4 affine.

    A 4D volume with a single volume along its 4th axis (``(X, Y, Z, 1)``, as some converters write) is taken as
    3D.

    Args:
        path: A ``.nii`` or ``.nii.gz`` file.

    Returns:
        ``(data, affine)``.

    Raises:
        ValueError: Naming the file: unreadable (truncated, not NIfTI), not 3D (2D, or 4D with several volumes),
            or holding NaN or infinite voxels.
    """
    try:
        import nibabel  # the medical extra; imported here so that `import datamodules` does not load it
        from nibabel.filebasedimages import ImageFileError
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"reading the NIfTI file {path} needs nibabel, which is not installed: install the medical extra: "
            "pip install -e '.[medical]'"
        ) from err

    try:
        image = nibabel.load(str(path))  # reads the header only
        check_claimed_size(path, tuple(int(n) for n in image.header.get_data_shape()),
                           image.header.get_data_dtype().itemsize, int(image.header.get_data_offset()))  # fmt: skip
        data = image.get_fdata(dtype=np.float32)
        affine = np.asarray(image.affine, dtype=np.float64)
    except (ImageFileError, OSError, EOFError, zlib.error) as err:
        raise ValueError(f"cannot read NIfTI volume {path}: {err}") from err
    except ValueError as err:
        raise ValueError(str(err) if str(path) in str(err) else f"cannot read NIfTI volume {path}: {err}") from err
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise ValueError(
            f"{path} is {data.ndim}D with shape {data.shape}; a 3D volume is expected (split a 4D series into one "
            "file per volume)"
        )
    if not np.isfinite(data).all():
        raise ValueError(f"{path} holds NaN or infinite voxels")
    return data, affine


def check_pair(
    image: Path,
    image_shape: tuple[int, ...],
    image_affine: np.ndarray,
    label: Path,
    label_shape: tuple[int, ...],
    label_affine: np.ndarray,
) -> None:
    """An image and its label must share the voxel grid: the same shape and the same affine (within 1e-3).

    Args:
        image: The image file.
        image_shape: Its voxel array's shape.
        image_affine: Its 4x4 affine.
        label: The label file.
        label_shape: Its voxel array's shape.
        label_affine: Its 4x4 affine.

    Raises:
        ValueError: Naming both files, with both shapes or the largest affine difference.
    """
    if image_shape != label_shape:
        raise ValueError(f"label {label} has shape {label_shape} but its image {image} has shape {image_shape}")
    if not np.allclose(image_affine, label_affine, atol=_AFFINE_ATOL):
        diff = float(np.abs(image_affine - label_affine).max())
        raise ValueError(
            f"label {label} and its image {image} have different affines (largest difference {diff:.4g}, allowed "
            f"{_AFFINE_ATOL}): they are not on the same voxel grid (resample the label onto the image)"
        )


# ------------------------------------------------------------------------------------------------ datamodule
