"""The checks every datamodule's loaded clients pass: shapes, dtypes, finite values, label ranges, unique ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from datamodules.split import check_labels

if TYPE_CHECKING:
    from datamodules.base import ClientSplit


def check_splits(
    splits: list[ClientSplit],
    sample_kind: str,
    label_kind: str,
    declared_num_classes: int | None,
    source: str,
    pooled_key: str,
) -> int:
    """Check every client's loaded splits; the number of classes (declared, else max label + 1; 2 for survival).

    Raises:
        ValueError: On no client, repeated ids, an empty training set, a wrong dtype or shape of samples, labels
            or domains, non-finite values, images outside [0, 1], or labels out of range, naming the client, the
            split and ``source``.
    """
    if not splits:
        raise ValueError(f"{source}: no clients were loaded")
    ids = [s.client_id for s in splits]
    if len(set(ids)) != len(ids) or pooled_key in ids:
        raise ValueError(f"{source}: client ids must be unique and not {pooled_key!r}, got {ids}")
    shape = tuple(splits[0].train_x.shape[1:])
    rank, what, unit, cells = (2, "features", "row", "values") if sample_kind == "table" else (
        4, "images", "image", "pixels")  # fmt: skip
    for s in splits:
        if len(s.train_y) == 0:
            raise ValueError(f"client {s.client_id!r} has no training samples ({source})")
        for name, x, y, dom in (
            ("train", s.train_x, s.train_y, s.train_domain),
            ("test", s.test_x, s.test_y, s.test_domain),
            ("validation", s.val_x, s.val_y, s.val_domain),
        ):
            if x.dtype != torch.float32 or x.ndim != rank or tuple(x.shape[1:]) != shape:
                raise ValueError(
                    f"client {s.client_id!r} {name} {what} must be float32 (N, {', '.join(map(str, shape))}), "
                    f"got {x.dtype} {tuple(x.shape)} ({source})"
                )
            check_label_shape(s.client_id, name, x, y, shape, sample_kind, label_kind, source)
            if dom is not None and tuple(dom.shape) != (len(x),):
                raise ValueError(f"client {s.client_id!r} {name} domains must hold one id per {unit} ({len(x)},)")
            if not bool(torch.isfinite(x).all()):
                # Checked first: NaN compares false with everything, so the range check below lets it through.
                bad = int((~torch.isfinite(x)).flatten(1).any(1).sum())
                raise ValueError(
                    f"client {s.client_id!r} {name} {what} hold NaN or infinite {cells} ({bad} of {len(x)} "
                    f"{unit}s) ({source})"
                )
            if sample_kind == "image" and x.numel() and (x.min() < 0 or x.max() > 1):
                raise ValueError(f"client {s.client_id!r} {name} images are outside [0, 1] ({source})")
    if label_kind == "survival":
        return 2  # censored / event: what label_counts counts
    if declared_num_classes is not None:
        num_classes = declared_num_classes
    else:
        num_classes = 1 + max(int(torch.cat([s.train_y, s.test_y, s.val_y]).max()) for s in splits)
    for s in splits:
        check_labels(s.train_y, num_classes, s.client_id, source)
        check_labels(s.test_y, num_classes, s.client_id, source)
        check_labels(s.val_y, num_classes, s.client_id, source)
    return num_classes


def check_label_shape(
    client_id: str,
    name: str,
    x: Tensor,
    y: Tensor,
    shape: tuple[int, ...],
    sample_kind: str,
    label_kind: str,
    source: str,
) -> None:
    """Refuse labels of the wrong shape or type, naming the client and split.

    One int64 label per sample (classification), one per pixel (segmentation masks), or for survival data a
    float32 ``(time, event)`` pair per sample.
    """
    if label_kind == "survival":
        if y.dtype != torch.float32 or tuple(y.shape) != (len(x), 2):
            raise ValueError(
                f"client {client_id!r} {name} labels must be float32 (time, event) pairs of shape ({len(x)}, 2), "
                f"got {y.dtype} {tuple(y.shape)} ({source})"
            )
        return
    label_shapes = ((len(x),), (len(x), *shape[1:])) if sample_kind == "image" else ((len(x),),)
    if y.dtype != torch.int64 or tuple(y.shape) not in label_shapes:
        expected = " or ".join(map(str, label_shapes))
        raise ValueError(
            f"client {client_id!r} {name} labels must be int64 of shape {expected}, got {y.dtype} "
            f"{tuple(y.shape)} ({source})"
        )
