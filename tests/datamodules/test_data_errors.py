"""Bad data fails up front with a message that names the client, the file and the numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules import DigitsFederated, MedMNISTFederated, SegFolderFederated
from datamodules.base import ClientSplit, FederatedDataModule
from datamodules.partition import check_clients_fit, min_samples_for_test
from datamodules.split import split_train_test
from fl_lightning.cli import instantiation_error_message, main


# ------------------------------------------------------------------------------------------ segmentation masks
def test_a_mask_of_another_size_than_its_image_names_client_and_file(tmp_path: Path):
    for name, mask_side in (("hospA", 12), ("hospB", 10)):
        (tmp_path / name / "images").mkdir(parents=True)
        (tmp_path / name / "masks").mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.zeros((12, 12), np.uint8)).save(tmp_path / name / "images" / f"case{i}.png")
            side = mask_side if i == 1 else 12
            Image.fromarray(np.zeros((side, side), np.uint8)).save(tmp_path / name / "masks" / f"case{i}.png")
    data = SegFolderFederated(tmp_path, num_classes=2, image_size=8)  # both are resized: the mismatch was hidden
    with pytest.raises(
        ValueError, match=r"client 'hospB': mask .*hospB/masks/case1\.png is 10x10 but its image .*12x12"
    ):
        _ = data.client_ids


# ------------------------------------------------------------------------------------------ partitions that cannot fit
@pytest.mark.parametrize(("fraction", "need"), [(0.0, 1), (0.2, 3), (0.25, 2), (0.1, 5), (0.5, 2)])
def test_min_samples_for_test_agrees_with_the_split(fraction, need):
    assert min_samples_for_test(fraction) == need
    labels = np.zeros(need, dtype=np.int64)
    train, test = split_train_test(np.arange(need), labels, fraction, seed=0)
    assert len(train) >= 1 and (fraction == 0 or len(test) >= 1)
    if need > 1:
        _, test = split_train_test(np.arange(need - 1), labels[:-1], fraction, seed=0)
        assert len(test) == 0  # one sample fewer: no test sample


def test_too_many_clients_for_the_data_fail_up_front_with_the_numbers():
    with pytest.raises(
        ValueError, match=r"digits: 1797 samples cannot give each of 1500 clients .*at most 599 clients"
    ):
        _ = DigitsFederated(num_clients=1500).client_ids
    with pytest.raises(ValueError, match=r"max_samples_per_client=2 leaves every client without a training and a test"):
        _ = DigitsFederated(num_clients=3, max_samples_per_client=2).client_ids
    check_clients_fit(1797, 599, 0.2, "digits")  # the largest that fits
    check_clients_fit(10, 10, 0.0, "x")  # no test sets wanted: one sample each is enough


# ------------------------------------------------------------------------------------------ MedMNIST files
def _medmnist(path: Path, **kwargs) -> MedMNISTFederated:
    return MedMNISTFederated(path, num_clients=2, **kwargs)


def test_a_file_that_is_not_npz_is_named_without_numpy_advice(tmp_path: Path):
    path = tmp_path / "pathmnist.npz"
    path.write_text("this is a CSV, not an archive\n1,2,3\n")
    with pytest.raises(ValueError, match=r"pathmnist\.npz is not a \.npz archive") as exc:
        _ = _medmnist(path).client_ids
    assert "allow_pickle" not in str(exc.value)
    npy = tmp_path / "single.npz"
    with npy.open("wb") as f:
        np.save(f, np.zeros(3))  # one .npy array under a .npz name
    with pytest.raises(ValueError, match=r"single\.npz is not a \.npz archive"):
        _ = _medmnist(npy).client_ids


def test_an_empty_npz_is_named(tmp_path: Path):
    path = tmp_path / "empty.npz"
    np.savez(path)
    with pytest.raises(ValueError, match=r"empty\.npz is an empty \.npz archive"):
        _ = _medmnist(path).client_ids
    no_images = tmp_path / "noimages.npz"
    np.savez(no_images, **{f"{s}_{k}": np.zeros((0, 28, 28) if k == "images" else (0, 1), dtype=np.uint8)
                          for s in ("train", "val", "test") for k in ("images", "labels")})  # fmt: skip
    with pytest.raises(ValueError, match=r"noimages\.npz holds no images"):
        _ = _medmnist(no_images).client_ids


def test_an_object_array_in_npz_is_named_without_numpy_advice(tmp_path: Path):
    path = tmp_path / "objects.npz"
    arrays = {f"{s}_{k}": np.zeros((4, 28, 28) if k == "images" else (4, 1), dtype=np.uint8)
              for s in ("train", "val", "test") for k in ("images", "labels")}  # fmt: skip
    arrays["train_images"] = np.array([{"a": 1}] * 4, dtype=object)
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=r"objects\.npz: array 'train_images' cannot be read") as exc:
        _ = _medmnist(path).client_ids
    assert "allow_pickle" not in str(exc.value)


# ------------------------------------------------------------------------------------------ non-finite pixels
class _Fixed(FederatedDataModule):
    def __init__(self, splits: list[ClientSplit]) -> None:
        super().__init__()
        self._splits_in = splits

    def _load(self) -> list[ClientSplit]:
        return self._splits_in


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pixels_are_refused_naming_the_client(bad):
    good = torch.rand(4, 1, 4, 4)
    poisoned = good.clone()
    poisoned[2, 0, 1, 1] = bad
    y = torch.zeros(4, dtype=torch.int64)
    data = _Fixed([ClientSplit("ok", good, y, good, y), ClientSplit("siteX", good, y, poisoned, y)])
    with pytest.raises(ValueError, match=r"client 'siteX' test images hold NaN or infinite pixels \(1 of 4 images\)"):
        _ = data.client_ids


# ------------------------------------------------------------------------------------------ range errors on the CLI
@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--data.alpha=-1", "invalid data (datamodules.DigitsFederated): alpha must be > 0, got -1.0"),
        ("--model.lr=-1", "invalid model (fl_lightning.clients.ClassificationClient): model.lr must be positive"),
    ],
)
def test_range_errors_are_not_buried_in_the_union_dump(tmp_path, arg, message):
    with pytest.raises(ValueError) as exc:
        main(["--config", "configs/fedavg_digits.yaml", f"--federation.output_dir={tmp_path}", arg])
    assert str(exc.value).startswith(message)
    assert "Union subtypes" not in str(exc.value) and "Namespace(" not in str(exc.value)


def test_instantiation_error_message_ignores_other_errors():
    assert instantiation_error_message(ValueError("invalid federation settings: federation.rounds=0")) is None
