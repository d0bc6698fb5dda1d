"""Per-client image folders: loading, class mapping, conversion, and the documented errors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules import ImageFolderFederated

# Pixel value per class so the class mapping can be read back from the loaded images.
_VALUE = {"benign": 40, "malignant": 200, "normal": 120}


def _write_png(path: Path, value: int, size: int = 10, mode: str = "L") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    color = value if mode == "L" else (value, value, value)
    Image.new(mode, (size, size), color).save(path)


def _make_tree(root: Path) -> Path:
    layout = {"hospA": {"benign": 3, "malignant": 2}, "hospB": {"malignant": 2, "normal": 3}}
    for client, classes in layout.items():
        for cls, n in classes.items():
            for i in range(n):
                suffix = ".png" if i % 2 == 0 else ".bmp"
                _write_png(root / client / cls / f"img{i}{suffix}", _VALUE[cls], mode="RGB" if i == 1 else "L")
    return root


def _all(dm: ImageFolderFederated, cid: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = dm.client_data(cid)
    return torch.cat([d.train_x, d.test_x]), torch.cat([d.train_y, d.test_y])


def test_loads_clients_and_maps_classes(tmp_path: Path) -> None:
    dm = ImageFolderFederated(_make_tree(tmp_path / "data"), image_size=8, test_fraction=0.25)
    assert dm.client_ids == ["hospA", "hospB"]
    assert dm.class_names == ["benign", "malignant", "normal"]
    assert dm.num_classes == 3 and dm.in_channels == 1 and dm.image_size == (8, 8)
    for cid, n in (("hospA", 5), ("hospB", 5)):
        x, y = _all(dm, cid)
        assert len(y) == n
        for label in y.unique().tolist():
            value = _VALUE[dm.class_names[label]] / 255
            torch.testing.assert_close(x[y == label].mean().item(), value, atol=1e-3, rtol=0)
    assert dm.label_counts("hospA", "train").tolist()[2] == 0
    assert (dm.label_counts("hospA") + dm.label_counts("hospA", "test")).tolist() == [3, 2, 0]


def test_given_classes_fix_the_label_order_and_rgb(tmp_path: Path) -> None:
    classes = ["normal", "malignant", "benign", "other"]
    dm = ImageFolderFederated(_make_tree(tmp_path / "data"), classes=classes, image_size=6, channels=3)
    assert dm.num_classes == 4 and dm.in_channels == 3
    x, y = _all(dm, "hospB")
    assert set(y.tolist()) == {0, 1}
    assert np.isclose(x[y == 0].mean().item(), 120 / 255, atol=1e-3)


def test_missing_root_names_it(tmp_path: Path) -> None:
    root = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match=re.escape(str(root))):
        ImageFolderFederated(root).setup()


def test_client_without_images_names_client_and_directory(tmp_path: Path) -> None:
    root = _make_tree(tmp_path / "data")
    (root / "hospC" / "benign").mkdir(parents=True)
    (root / "hospC" / "benign" / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match=r"client 'hospC' has no images in .*hospC"), pytest.warns(UserWarning):
        ImageFolderFederated(root).setup()


def test_class_directory_outside_given_classes(tmp_path: Path) -> None:
    root = _make_tree(tmp_path / "data")
    with pytest.raises(ValueError, match=r"client 'hospB'.*normal.*\['benign', 'malignant'\]"):
        ImageFolderFederated(root, classes=["benign", "malignant"]).setup()


def test_unreadable_image_names_the_file(tmp_path: Path) -> None:
    root = _make_tree(tmp_path / "data")
    broken = root / "hospA" / "benign" / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"cannot read image .*broken\.png"):
        ImageFolderFederated(root).setup()


def test_image_outside_class_directory_is_rejected(tmp_path: Path) -> None:
    root = _make_tree(tmp_path / "data")
    _write_png(root / "hospA" / "stray.png", 10)
    with pytest.raises(ValueError, match=r"hospA.*stray\.png.*not inside a class directory"):
        ImageFolderFederated(root).setup()


def test_empty_class_directory_in_no_client_is_refused_naming_client_and_directory(tmp_path: Path) -> None:
    # An empty 'tumour' directory is the only trace of that class: taking it would add a class without samples.
    root = _make_tree(tmp_path / "data")
    (root / "hospB" / "tumour").mkdir()
    with pytest.raises(ValueError, match=r"\['tumour'\].*client 'hospB': .*hospB.tumour.*pass classes="):
        ImageFolderFederated(root).setup()
    # Declaring the classes is the documented way to keep a class no client has images of.
    dm = ImageFolderFederated(root, classes=["benign", "malignant", "normal", "tumour"])
    assert dm.num_classes == 4


def test_empty_class_directory_of_a_class_other_clients_have_warns_naming_client(tmp_path: Path) -> None:
    root = _make_tree(tmp_path / "data")
    (root / "hospB" / "benign").mkdir()
    dm = ImageFolderFederated(root, image_size=8)
    with pytest.warns(UserWarning, match=r"client 'hospB': class directory .*hospB.benign has no images"):
        assert dm.num_classes == 3
    assert dm.class_names == ["benign", "malignant", "normal"]
    assert (dm.label_counts("hospB") + dm.label_counts("hospB", "test")).tolist() == [0, 2, 3]
