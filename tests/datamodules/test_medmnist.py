"""MedMNIST .npz files: loading, pooling, conversion, and the documented errors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import MedMNISTFederated


def _write_npz(path: Path, *, rgb: bool = False, drop: str | None = None, **overrides: np.ndarray) -> Path:
    """Writes a fake MedMNIST file: 60 images 28x28 (40/10/10), 4 classes, labels shaped (N, 1)."""
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {}
    for split, n in (("train", 40), ("val", 10), ("test", 10)):
        shape = (n, 28, 28, 3) if rgb else (n, 28, 28)
        arrays[f"{split}_images"] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % 4).reshape(n, 1).astype(np.uint8)
    arrays.update(overrides)
    if drop:
        del arrays[drop]
    np.savez(path, **arrays)
    return path


def test_loads_pools_and_partitions(tmp_path: Path) -> None:
    path = _write_npz(tmp_path / "fake.npz")
    dm = MedMNISTFederated(path, num_clients=3, seed=0)
    assert dm.client_ids == ["client0", "client1", "client2"]
    assert dm.num_classes == 4 and dm.in_channels == 1 and dm.image_size == (28, 28)
    total = sum(dm.num_train_samples(c) + dm.num_test_samples(c) for c in dm.client_ids)
    assert total == 60
    x = dm.client_data("client0").train_x
    assert x.dtype == torch.float32 and x.min() >= 0 and x.max() <= 1
    # Pixel values are the file's bytes / 255 (no styles by default).
    assert torch.allclose(x * 255, (x * 255).round(), atol=1e-3)
    assert len(list(dm.client_train_loader("client1", steps=2))) == 2


def test_resize_channels_and_declared_classes(tmp_path: Path) -> None:
    path = _write_npz(tmp_path / "rgb.npz", rgb=True)
    dm = MedMNISTFederated(path, num_clients=2, image_size=16, channels=1, num_classes=6, partition="dirichlet")
    assert dm.in_channels == 1 and dm.image_size == (16, 16) and dm.num_classes == 6
    assert dm.label_counts("client0").shape == (6,)
    rgb = MedMNISTFederated(path, num_clients=2, site_styles=True)
    assert rgb.in_channels == 3
    gray_to_rgb = MedMNISTFederated(_write_npz(tmp_path / "g.npz"), num_clients=2, channels=3)
    x = gray_to_rgb.client_data("client0").train_x
    assert x.shape[1] == 3 and torch.equal(x[:, 0], x[:, 2])


def test_flat_labels_accepted(tmp_path: Path) -> None:
    labels = {f"{s}_labels": np.arange(n) % 4 for s, n in (("train", 40), ("val", 10), ("test", 10))}
    dm = MedMNISTFederated(_write_npz(tmp_path / "flat.npz", **labels), num_clients=2, partition="pathological")
    assert all((dm.label_counts(c) + dm.label_counts(c, "test") > 0).sum() == 2 for c in dm.client_ids)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "pathmnist.npz"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        MedMNISTFederated(missing).setup()


def test_missing_key_names_key_and_file(tmp_path: Path) -> None:
    path = _write_npz(tmp_path / "nokey.npz", drop="val_labels")
    with pytest.raises(KeyError, match=r"val_labels.*nokey\.npz"):
        MedMNISTFederated(path).setup()


def test_label_out_of_range_names_file_split_and_value(tmp_path: Path) -> None:
    bad = (np.arange(10) % 4).reshape(10, 1)
    bad[3] = 9
    path = _write_npz(tmp_path / "bad.npz", test_labels=bad)
    with pytest.raises(ValueError, match=r"bad\.npz.*test split.*label 9"):
        MedMNISTFederated(path, num_classes=4).setup()


def test_negative_label_rejected_when_classes_inferred(tmp_path: Path) -> None:
    bad = (np.arange(10) % 4).reshape(10, 1).astype(np.int64)
    bad[0] = -1
    path = _write_npz(tmp_path / "neg.npz", val_labels=bad)
    with pytest.raises(ValueError, match=r"neg\.npz.*val split.*label -1"):
        MedMNISTFederated(path).setup()


def test_multi_label_rejected_naming_file(tmp_path: Path) -> None:
    multi = np.zeros((40, 14), dtype=np.uint8)
    path = _write_npz(tmp_path / "chestmnist.npz", train_labels=multi)
    with pytest.raises(ValueError, match=r"chestmnist\.npz.*multi-label.*not supported"):
        MedMNISTFederated(path).setup()


def test_bad_image_shape_and_bad_partition(tmp_path: Path) -> None:
    path = _write_npz(tmp_path / "shape.npz", train_images=np.zeros((40, 28), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"shape\.npz.*train_images"):
        MedMNISTFederated(path).setup()
    with pytest.raises(ValueError, match="partition"):
        MedMNISTFederated(path, partition="domain")
