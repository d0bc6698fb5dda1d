"""Image/mask folder pairs per client: loading, value mapping, and errors that name the client and file."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules import SegFolderFederated


def write_client(root: Path, name: str, n: int, size: int = 12, values=(0, 255)) -> None:
    rng = np.random.default_rng(len(name) + n)
    (root / name / "images").mkdir(parents=True)
    (root / name / "masks").mkdir(parents=True)
    for i in range(n):
        mask = np.where(rng.random((size, size)) > 0.5, values[1], values[0]).astype(np.uint8)
        image = (mask // 2 + rng.integers(0, 60, (size, size))).astype(np.uint8)
        Image.fromarray(image).save(root / name / "images" / f"case{i}.png")
        Image.fromarray(mask).save(root / name / "masks" / f"case{i}.png")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_client(tmp_path, "hospA", 6)
    write_client(tmp_path, "hospB", 4)
    return tmp_path


def test_loads_pairs_per_client_with_mapped_values(root: Path):
    dm = SegFolderFederated(root, mask_values=[0, 255], image_size=12, test_fraction=0.25)
    assert dm.client_ids == ["hospA", "hospB"] and dm.num_classes == 2
    d = dm.client_data("hospA")
    assert len(d.train_x) + len(d.test_x) == 6 and d.train_x.shape[1:] == (1, 12, 12)
    assert d.train_y.shape == (len(d.train_x), 12, 12) and set(torch.unique(d.train_y).tolist()) == {0, 1}
    mask = np.asarray(Image.open(root / "hospA" / "masks" / "case0.png"))
    all_masks = torch.cat([d.train_y, d.test_y])
    assert any(torch.equal(m, torch.as_tensor(mask == 255).long()) for m in all_masks)
    resized = SegFolderFederated(root, mask_values=[0, 255], image_size=6)
    assert set(torch.unique(resized.client_data("hospB").train_y).tolist()) <= {0, 1}  # nearest: no new values


def test_class_id_masks_without_mapping(tmp_path: Path):
    write_client(tmp_path, "a", 3, values=(0, 2))
    dm = SegFolderFederated(tmp_path, image_size=12, test_fraction=0.0)
    assert dm.num_classes == 3
    with pytest.raises(ValueError, match=r"client 'a': mask .*case\d\.png has value 2 outside the classes \[0, 2\)"):
        SegFolderFederated(tmp_path, num_classes=2, image_size=12).setup()


def test_errors_name_the_client_and_file(root: Path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        SegFolderFederated(root / "nowhere").setup()
    with pytest.raises(ValueError, match=r"value 255 not in mask_values \[0, 1\]"):
        SegFolderFederated(root, mask_values=[0, 1]).setup()
    (root / "hospB" / "masks" / "case3.png").unlink()
    with pytest.raises(ValueError, match=r"client 'hospB': image .*case3\.png has no mask"):
        SegFolderFederated(root, mask_values=[0, 255]).setup()
    (root / "hospB" / "images" / "case3.png").unlink()
    Image.fromarray(np.zeros((12, 12), np.uint8)).save(root / "hospB" / "masks" / "extra.png")
    with pytest.raises(ValueError, match=r"client 'hospB': mask .*extra\.png has no image"):
        SegFolderFederated(root, mask_values=[0, 255]).setup()
    (root / "hospB" / "masks" / "extra.png").unlink()
    Image.fromarray(np.zeros((12, 12, 3), np.uint8)).save(root / "hospB" / "masks" / "case2.png")
    with pytest.raises(ValueError, match=r"cannot read mask .*case2\.png: .*one channel"):
        SegFolderFederated(root, mask_values=[0, 255]).setup()
    Image.fromarray(np.zeros((12, 12), np.uint8)).save(root / "hospB" / "masks" / "case2.png")
    write_client(root, "hospC", 0)
    (root / "hospC" / "masks").rmdir()
    with pytest.raises(ValueError, match=r"client 'hospC': missing directory .*masks"):
        SegFolderFederated(root, mask_values=[0, 255]).setup()
    with pytest.raises(ValueError, match="mask_values"):
        SegFolderFederated(root, num_classes=3, mask_values=[0, 255])
