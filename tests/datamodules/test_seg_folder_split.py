"""A given train/test split for segmentation folders: train/ and test/ sub-folders or a split file.

Every image written here carries its own id in its first pixel, so a test can say exactly which images (and in
which order) ended up in a client's train and test sets.
"""

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules import SegFolderFederated
from datamodules.sampler import stable_seed
from datamodules.split import split_train_test
from fl_lightning.cli import main

REPO = Path(__file__).resolve().parents[2]
SIZE = 12


def write_pairs(folder: Path, ids: list[int], size: int = SIZE, stems: list[str] | None = None) -> None:
    """``folder/images/<stem>.png`` + ``folder/masks/<stem>.png`` per id; the image's first pixel is the id."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "masks").mkdir(parents=True, exist_ok=True)
    for k, ident in enumerate(ids):
        rng = np.random.default_rng(ident)
        mask = (rng.random((size, size)) > 0.5).astype(np.uint8)  # class ids 0/1
        image = (mask * 100 + rng.integers(0, 60, (size, size))).astype(np.uint8)
        image[0, 0] = ident
        stem = stems[k] if stems is not None else f"case{ident:03d}"
        Image.fromarray(image).save(folder / "images" / f"{stem}.png")
        Image.fromarray(mask).save(folder / "masks" / f"{stem}.png")


def ids(x: torch.Tensor) -> list[int]:
    """The ids (first pixels) of a batch of loaded images, in order."""
    return [round(float(v) * 255) for v in x[:, 0, 0, 0]]


def check_masks_follow_images(data) -> None:
    """Each mask is its own image's (the mask is rebuilt from the id's seed)."""
    for x, y in ((data.train_x, data.train_y), (data.test_x, data.test_y)):
        for ident, mask in zip(ids(x), y, strict=True):
            expected = (np.random.default_rng(ident).random((SIZE, SIZE)) > 0.5).astype(np.int64)
            assert torch.equal(mask, torch.as_tensor(expected)), ident


@pytest.fixture
def split_root(tmp_path: Path) -> Path:
    """Two clients with train/ and test/ sub-folders; the test stems are written out of order."""
    root = tmp_path / "data"
    write_pairs(root / "hospA" / "train", [1, 2, 3, 4])
    write_pairs(root / "hospA" / "test", [12, 10, 11], stems=["zeta", "alpha", "mid"])
    write_pairs(root / "hospB" / "train", [21, 22, 23])
    write_pairs(root / "hospB" / "test", [31, 30])
    return root


@pytest.fixture
def flat_root(tmp_path: Path) -> Path:
    """Two clients with today's images/ + masks/ layout."""
    root = tmp_path / "flat"
    write_pairs(root / "hospA", [1, 2, 3, 4, 5, 6])
    write_pairs(root / "hospB", [11, 12, 13, 14])
    return root


# ------------------------------------------------------------------------------------------------ sub-folders


def test_subfolder_split_is_honoured_exactly(split_root: Path, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="datamodules.seg_folder"):
        dm = SegFolderFederated(split_root, image_size=SIZE, test_fraction=0.5, seed=7)
        assert dm.client_ids == ["hospA", "hospB"] and dm.num_classes == 2
    a, b = dm.client_data("hospA"), dm.client_data("hospB")
    assert ids(a.train_x) == [1, 2, 3, 4] and ids(b.train_x) == [21, 22, 23]
    # Exactly the test folder's images, in stem order (alpha, mid, zeta), whatever test_fraction and seed say.
    assert ids(a.test_x) == [10, 11, 12] and ids(b.test_x) == [30, 31]
    check_masks_follow_images(a)
    check_masks_follow_images(b)
    assert "test_fraction is ignored" in caplog.text
    again = SegFolderFederated(split_root, image_size=SIZE, test_fraction=0.1, seed=0).client_data("hospA")
    assert torch.equal(again.test_x, a.test_x) and torch.equal(again.train_y, a.train_y)


def test_subfolder_pairing_is_checked_per_split(split_root: Path):
    (split_root / "hospB" / "test" / "masks" / "case031.png").unlink()
    with pytest.raises(ValueError, match=r"client 'hospB': image .*hospB/test/images/case031\.png has no mask"):
        SegFolderFederated(split_root, image_size=SIZE).setup()
    (split_root / "hospB" / "test" / "images" / "case031.png").unlink()
    Image.fromarray(np.zeros((SIZE, SIZE), np.uint8)).save(split_root / "hospB" / "train" / "masks" / "stray.png")
    with pytest.raises(ValueError, match=r"client 'hospB': mask .*hospB/train/masks/stray\.png has no image"):
        SegFolderFederated(split_root, image_size=SIZE).setup()


def test_subfolder_client_without_test_images_is_named(split_root: Path):
    for f in (split_root / "hospB" / "test").rglob("*.png"):
        f.unlink()
    with pytest.raises(ValueError, match=r"client 'hospB' has no images in .*hospB/test/images"):
        SegFolderFederated(split_root, image_size=SIZE).setup()
    for f in sorted((split_root / "hospB" / "test").rglob("*"), reverse=True):
        f.rmdir()
    (split_root / "hospB" / "test").rmdir()
    with pytest.raises(ValueError, match=r"client 'hospB': .*hospB/train has no test/ sibling"):
        SegFolderFederated(split_root, image_size=SIZE).setup()


def test_both_layouts_in_one_client_is_named(split_root: Path):
    write_pairs(split_root / "hospA", [99])
    with pytest.raises(ValueError, match=r"client 'hospA' holds train/ and test/ sub-folders and also .*images"):
        SegFolderFederated(split_root, image_size=SIZE).setup()


def test_mixed_layouts_name_the_clients_unless_a_split_file_is_given(split_root: Path, tmp_path: Path):
    write_pairs(split_root / "hospC", [41, 42, 43])
    with pytest.raises(ValueError, match=r"mixed layouts: client\(s\) 'hospA', 'hospB' have train/ .* 'hospC' do not"):
        SegFolderFederated(split_root, image_size=SIZE).setup()
    lines = ["client,image,split"]
    lines += [f"hospA,train/images/case00{i}.png,train" for i in (1, 2, 3, 4)]
    lines += [f"hospA,test/images/{s}.png,test" for s in ("alpha", "mid", "zeta")]
    lines += [f"hospB,train/images/case0{i}.png,train" for i in (21, 22, 23)]
    lines += [f"hospB,test/images/case0{i}.png,test" for i in (30, 31)]
    lines += ["hospC,images/case041.png,train", "hospC,images/case042.png,test", "hospC,images/case043.png,train"]
    split_file = tmp_path / "split.csv"
    split_file.write_text("\n".join(lines) + "\n")
    dm = SegFolderFederated(split_root, image_size=SIZE, split_file=split_file)
    assert ids(dm.client_data("hospA").test_x) == [10, 11, 12]
    c = dm.client_data("hospC")
    assert ids(c.train_x) == [41, 43] and ids(c.test_x) == [42]


# ------------------------------------------------------------------------------------------------- split file


def test_split_file_is_honoured_in_file_order(flat_root: Path, tmp_path: Path):
    split_file = tmp_path / "official.csv"
    split_file.write_text(
        "client,image,split\n"
        "# the official split\n"
        "hospA,images/case005.png,test\n"
        "hospA,images/case001.png,TEST\n"
        "hospA,images/case002.png,train\n"
        "hospA,images/case006.png,train\n"
        "hospA,images/case003.png,train\n"
        "hospA,images/case004.png,train\n"
        "\n"
        'hospB,"images/case011.png",train\n'
        "hospB,images/case012.png,train\n"
        "hospB,images/case013.png,test\n"
        "hospB,images/case014.png,train\n"
    )
    dm = SegFolderFederated(flat_root, image_size=SIZE, test_fraction=0.0, split_file=str(split_file))
    a, b = dm.client_data("hospA"), dm.client_data("hospB")
    assert ids(a.test_x) == [5, 1] and ids(a.train_x) == [2, 6, 3, 4]
    assert ids(b.test_x) == [13] and ids(b.train_x) == [11, 12, 14]
    check_masks_follow_images(a)
    check_masks_follow_images(b)


def test_text_split_file_with_paths_from_the_root(flat_root: Path, tmp_path: Path):
    split_file = tmp_path / "split.txt"
    rows = [f"hospA/images/case00{i}.png {'test' if i in (2, 4) else 'train'}" for i in range(1, 7)]
    rows += [f"hospB/images/case0{i}.png\t{'test' if i == 14 else 'train'}" for i in range(11, 15)]
    split_file.write_text("image split\n" + "\n".join(rows) + "\n")
    dm = SegFolderFederated(flat_root, image_size=SIZE, split_file=split_file)
    assert ids(dm.client_data("hospA").test_x) == [2, 4] and ids(dm.client_data("hospA").train_x) == [1, 3, 5, 6]
    assert ids(dm.client_data("hospB").test_x) == [14]


def test_split_file_overrides_the_subfolders(split_root: Path, tmp_path: Path):
    split_file = tmp_path / "split.csv"
    lines = [f"hospA/train/images/case00{i}.png,{'test' if i == 4 else 'train'}" for i in (1, 2, 3, 4)]
    lines += [f"hospA/test/images/{s}.png,test" for s in ("alpha", "mid", "zeta")]
    lines += [f"hospB/train/images/case0{i}.png,train" for i in (21, 22, 23)]
    lines += ["hospB/test/images/case030.png,train", "hospB/test/images/case031.png,test"]
    split_file.write_text("\n".join(lines))
    dm = SegFolderFederated(split_root, image_size=SIZE, split_file=split_file)
    assert ids(dm.client_data("hospA").test_x) == [4, 10, 11, 12]
    assert ids(dm.client_data("hospB").train_x) == [21, 22, 23, 30] and ids(dm.client_data("hospB").test_x) == [31]


def flat_lines(test: set[int]) -> list[str]:
    a = [f"hospA,images/case00{i}.png,{'test' if i in test else 'train'}" for i in range(1, 7)]
    return a + [f"hospB,images/case0{i}.png,{'test' if i in test else 'train'}" for i in range(11, 15)]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_split_file_errors_name_the_file_line_and_client(flat_root: Path, tmp_path: Path):
    def load(lines: list[str]) -> None:
        SegFolderFederated(flat_root, image_size=SIZE, split_file=write_lines(tmp_path / "s.csv", lines)).setup()

    good = flat_lines({2, 12})
    with pytest.raises(FileNotFoundError, match=r"split file not found: .*nowhere\.csv"):
        SegFolderFederated(flat_root, split_file=tmp_path / "nowhere.csv").setup()
    # A listed image that does not exist.
    with pytest.raises(FileNotFoundError, match=r"split file .*s\.csv line 3: image .*hospA/images/case099\.png not"):
        load([*good[:2], "hospA,images/case099.png,train", *good[2:]])
    # An unknown split value.
    with pytest.raises(
        ValueError, match=r"split file .*s\.csv line 5: split must be 'train', 'test' or 'val', got 'vl'"
    ):
        load([*good[:4], good[4].replace(",train", ",vl"), *good[5:]])
    # A client with no test image.
    with pytest.raises(ValueError, match=r"split file .*s\.csv gives client 'hospB' no test image"):
        load(flat_lines({2}))
    with pytest.raises(ValueError, match=r"split file .*s\.csv gives client 'hospA' no train image"):
        load(flat_lines({1, 2, 3, 4, 5, 6, 12}))
    # An image of a listed client that the file leaves out (strict: never silently dropped).
    with pytest.raises(ValueError, match=r"s\.csv does not list image .*case013\.png of client 'hospB' \(1 unlisted\)"):
        load([line for line in good if "case013" not in line])
    # A client folder the file does not list at all.
    with pytest.raises(ValueError, match=r"s\.csv lists no image of client\(s\) 'hospB'; every client folder"):
        load([line for line in good if line.startswith("hospA")])
    # A client the root does not have.
    with pytest.raises(ValueError, match=r"s\.csv line 11: client 'hospZ' has no folder"):
        load([*good, "hospZ,images/case001.png,train"])
    # An image listed twice.
    with pytest.raises(ValueError, match=r"s\.csv line 11: image .*case001\.png is already listed on line 1"):
        load([*good, "hospA,images/case001.png,test"])
    # A file that is not one of the client's paired images (here: a mask).
    with pytest.raises(ValueError, match=r"s\.csv line 1: .*masks/case001\.png is not an image of client 'hospA'"):
        load(["hospA,masks/case001.png,train", *good[1:]])
    # Malformed lines.
    with pytest.raises(ValueError, match=r"s\.csv line 2: expected client,image,split or image,split, got 4"):
        load([good[0], "hospA,images/case002.png,train,extra", *good[2:]])
    with pytest.raises(ValueError, match=r"s\.csv line 1: in the image,split form .*starts with its client folder"):
        load(["case001.png,train", *good[1:]])
    with pytest.raises(ValueError, match=r"s\.csv lists no images"):
        load(["# nothing", "client,image,split"])


def test_split_file_keeps_the_pairing_checks(flat_root: Path, tmp_path: Path):
    (flat_root / "hospA" / "masks" / "case003.png").unlink()
    split_file = write_lines(tmp_path / "s.csv", flat_lines({2, 12}))
    with pytest.raises(ValueError, match=r"client 'hospA': image .*case003\.png has no mask"):
        SegFolderFederated(flat_root, image_size=SIZE, split_file=split_file).setup()


# -------------------------------------------------------------------------------------------- random (default)

# Recorded with the loader before the given splits existed: 7 and 5 pairs, test_fraction 0.3 (positions in stem
# order). The random split depends only on the number of pairs, the seed and the client id.
BEFORE = {
    0: {"hospA": ([0, 1, 2, 3, 6], [4, 5]), "hospB": ([0, 1, 4], [2, 3])},
    3: {"hospA": ([0, 2, 3, 4, 6], [1, 5]), "hospB": ([0, 1, 3], [2, 4])},
}


@pytest.mark.parametrize("seed", sorted(BEFORE))
def test_random_split_is_unchanged_without_a_given_split(tmp_path: Path, seed: int):
    stems = {"hospA": list(range(1, 8)), "hospB": list(range(11, 16))}
    for client, numbers in stems.items():
        write_pairs(tmp_path / client, numbers)
    dm = SegFolderFederated(tmp_path, image_size=SIZE, test_fraction=0.3, seed=seed)
    for client, numbers in stems.items():
        data = dm.client_data(client)
        train, test = BEFORE[seed][client]
        assert ids(data.train_x) == [numbers[i] for i in train] and ids(data.test_x) == [numbers[i] for i in test]
        # The same split as split_train_test's seeded choice, as the loader has always made it.
        idx = np.arange(len(numbers))
        ref_train, ref_test = split_train_test(
            idx, np.zeros(len(idx), dtype=np.int64), 0.3, stable_seed(seed, "split", client)
        )
        assert ref_train.tolist() == train and ref_test.tolist() == test
        check_masks_follow_images(data)
    # The same split written as a split file gives the same tensors.
    lines = [
        f"{client},images/case{n:03d}.png,{'test' if k in BEFORE[seed][client][1] else 'train'}"
        for client, numbers in stems.items()
        for k, n in enumerate(numbers)
    ]
    given = SegFolderFederated(
        tmp_path, image_size=SIZE, split_file=write_lines(tmp_path.parent / f"s{seed}.csv", lines)
    )
    for client in stems:
        mine, theirs = given.client_data(client), dm.client_data(client)
        assert torch.equal(mine.train_x, theirs.train_x) and torch.equal(mine.test_y, theirs.test_y)


# ---------------------------------------------------------------------------------------------------- FedAvg


def test_one_fedavg_round_on_a_subfolder_layout(tmp_path: Path):
    root = tmp_path / "data"
    write_pairs(root / "siteA" / "train", [1, 2, 3, 4, 5, 6], size=16)
    write_pairs(root / "siteA" / "test", [7, 8], size=16)
    write_pairs(root / "siteB" / "train", [11, 12, 13, 14], size=16)
    write_pairs(root / "siteB" / "test", [15, 16, 17], size=16)
    summary = main(
        [
            "--config",
            str(REPO / "configs" / "fedavg_digits_seg.yaml"),
            "--data.class_path=datamodules.SegFolderFederated",
            f"--data.root={root}",
            "--data.image_size=16",
            "--data.batch_size=4",
            "--model.init_args.width=4",
            "--trainer.logger=false",
            "--federation.rounds=1",
            "--federation.progress=false",
            f"--federation.output_dir={tmp_path / 'runs'}",
        ]
    )
    assert summary["rounds"] == 1
    assert {cid: c["test_samples"] for cid, c in summary["clients"].items()} == {"siteA": 2, "siteB": 3}


# ------------------------------------------------------------------------------------------------ official validation


def test_val_subfolders_are_the_official_validation_sets(split_root: Path):
    write_pairs(split_root / "hospA" / "val", [41, 40])
    write_pairs(split_root / "hospB" / "val", [50])
    dm = SegFolderFederated(split_root, image_size=SIZE)
    a, b = dm.client_data("hospA"), dm.client_data("hospB")
    assert ids(a.val_x) == [40, 41] and ids(b.val_x) == [50] and dm.has_validation
    assert ids(a.train_x) == [1, 2, 3, 4] and ids(a.test_x) == [10, 11, 12]  # nothing moved
    for ident, mask in zip(ids(a.val_x), a.val_y, strict=True):
        expected = (np.random.default_rng(ident).random((SIZE, SIZE)) > 0.5).astype(np.int64)
        assert torch.equal(mask, torch.as_tensor(expected))
    with pytest.raises(ValueError, match=r"client\(s\) 'hospA', 'hospB' have official validation images .* "
                       r"val_fraction=0.25 would carve another"):  # fmt: skip
        SegFolderFederated(split_root, image_size=SIZE, val_fraction=0.25).setup()


def test_split_file_val_lines_are_the_official_validation_set(flat_root: Path, tmp_path: Path):
    split_file = tmp_path / "s.csv"
    split_file.write_text(
        "client,image,split\n"
        "hospA,images/case001.png,train\nhospA,images/case002.png,val\nhospA,images/case003.png,test\n"
        "hospA,images/case004.png,train\nhospA,images/case005.png,VAL\nhospA,images/case006.png,train\n"
        "hospB,images/case011.png,train\nhospB,images/case012.png,test\nhospB,images/case013.png,train\n"
        "hospB,images/case014.png,train\n"
    )
    dm = SegFolderFederated(flat_root, image_size=SIZE, split_file=split_file)
    a, b = dm.client_data("hospA"), dm.client_data("hospB")
    assert ids(a.val_x) == [2, 5] and ids(a.train_x) == [1, 4, 6] and ids(a.test_x) == [3]
    assert len(b.val_x) == 0 and ids(b.train_x) == [11, 13, 14]  # a client without val lines has none (not carved)
