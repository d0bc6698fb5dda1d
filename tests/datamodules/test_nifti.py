"""NIfTI volumes per site: slicing, normalisation, patient-level splits, sites as clients, errors naming the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import NiftiSegFederated
from datamodules.nifti import (
    assign_clients,
    case_name,
    map_labels,
    normalize_volume,
    resize_slices,
    select_slices,
    split_cases,
)

nib = pytest.importorskip("nibabel", reason="NIfTI volumes need the `medical` extra: pip install -e '.[medical]'")

SHAPE = (16, 16, 6)
FOREGROUND = (1, 2, 3, 4)  # the slices along axis 2 that hold the blob


def save(path: Path, data: np.ndarray, affine: np.ndarray | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, np.eye(4) if affine is None else affine), str(path))


def blob_label(shape=SHAPE, z=FOREGROUND) -> np.ndarray:
    label = np.zeros(shape, np.uint8)
    label[4:10, 5:11, list(z)] = 1
    return label


def write_case(site_dir: Path, name: str, seed: int, label: np.ndarray | None = None, ext: str = ".nii.gz") -> None:
    label = blob_label() if label is None else label
    rng = np.random.default_rng(seed)
    image = (100 + 300 * label.astype(np.float32) + rng.normal(0, 20, label.shape)).astype(np.float32) * (1 + seed % 3)
    save(site_dir / "images" / f"{name}{ext}", image)
    save(site_dir / "labels" / f"{name}{ext}", label)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 sites x 3 cases of 16x16x6 volumes, a blob label in slices 1-4 along axis 2."""
    root = tmp_path_factory.mktemp("nifti")
    for s, site in enumerate(("hospA", "hospB", "hospC")):
        for c in range(3):
            write_case(root / site, f"case{c}", seed=10 * s + c, ext=".nii" if c == 2 else ".nii.gz")
    return root


def copy_tree(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------------ helpers


def test_case_names_and_slice_selection():
    assert case_name(Path("a/case01.nii.gz")) == "case01" and case_name(Path("B.NII")) == "B"
    assert case_name(Path("x.png")) is None and case_name(Path(".nii.gz")) is None
    label = blob_label()
    assert select_slices(label, 2).tolist() == [1, 2, 3, 4]
    assert select_slices(label, 2, "all").tolist() == [0, 1, 2, 3, 4, 5]
    assert select_slices(label, 2, "foreground", every_k=2).tolist() == [1, 3]
    assert select_slices(label, 2, "all", every_k=4).tolist() == [0, 4]
    assert select_slices(label, 0).tolist() == list(range(4, 10))
    assert select_slices(np.zeros(SHAPE), 1).tolist() == []


def test_normalisation_values_on_a_hand_made_volume():
    vol = np.arange(8, dtype=np.float32).reshape(2, 2, 2)  # 0 .. 7
    np.testing.assert_allclose(normalize_volume(vol, "minmax").ravel(), np.arange(8) / 7, atol=1e-6)
    z = normalize_volume(vol, "zscore").ravel()
    expected = (np.clip((np.arange(8) - 3.5) / np.arange(8).std(), -3, 3) + 3) / 6
    np.testing.assert_allclose(z, expected, atol=1e-6)
    assert abs(float(normalize_volume(np.array([1.0, 2.0, 3.0]), "zscore")[1]) - 0.5) < 1e-6  # mean -> 0.5
    # percentile: one hot voxel among 999 ordinary ones is clipped instead of squashing the rest towards 0
    spike = np.concatenate([np.linspace(0, 1, 999), [1000.0]]).astype(np.float32)
    p = normalize_volume(spike, "percentile")
    lo, hi = np.percentile(spike.astype(np.float64), [0.5, 99.5])
    np.testing.assert_allclose(p, (np.clip(spike, lo, hi) - lo) / (hi - lo), atol=1e-6)
    assert p[-1] == 1.0 and p[0] == 0.0 and p[500] > 0.4 and normalize_volume(spike, "minmax")[500] < 0.001
    assert normalize_volume(np.full((3, 3), 5.0), "minmax").max() == 0.0
    assert set(normalize_volume(np.full((3, 3), 5.0), "zscore").ravel().tolist()) == {0.5}
    for method in ("minmax", "zscore", "percentile"):
        out = normalize_volume(np.random.default_rng(0).normal(0, 50, (4, 5, 6)), method)
        assert out.dtype == np.float32 and out.min() >= 0 and out.max() <= 1


def test_case_split_and_client_deal():
    for n in range(1, 12):
        train, test = split_cases(n, 0.2, seed=n)
        assert sorted([*train, *test]) == list(range(n)) and len(train) >= 1
        assert len(test) == (0 if n == 1 else max(1, round(n * 0.2)))
    assert len(split_cases(5, 0.0, 0)[1]) == 0
    assert split_cases(9, 0.3, 1)[1].tolist() == split_cases(9, 0.3, 1)[1].tolist()
    parts = assign_clients(7, 3, seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(7)) and sorted(map(len, parts)) == [2, 2, 3]


def test_label_mapping_and_resize():
    raw = np.array([[0.0, 1.0], [2.0, 1.0]])
    assert map_labels(raw, 2, {0: 0, 1: 1, 2: 1}, Path("l.nii")).tolist() == [[0, 1], [1, 1]]
    assert map_labels(raw, 3, None, Path("l.nii")).tolist() == [[0, 1], [2, 1]]
    with pytest.raises(ValueError, match=r"label l\.nii has value 2 outside the classes \[0, 2\)"):
        map_labels(raw, 2, None, Path("l.nii"))
    with pytest.raises(ValueError, match=r"value 2 not in label_map"):
        map_labels(raw, 2, {0: 0, 1: 1}, Path("l.nii"))
    with pytest.raises(ValueError, match=r"non-integer value 0\.5"):
        map_labels(raw / 2, 2, None, Path("l.nii"))
    x, y = resize_slices(torch.rand(2, 10, 7), torch.randint(0, 3, (2, 10, 7)), 5)
    assert x.shape == (2, 1, 5, 5) and y.shape == (2, 5, 5) and y.dtype == torch.int64
    assert set(y.unique().tolist()) <= {0, 1, 2} and 0 <= x.min() and x.max() <= 1


# --------------------------------------------------------------------------------------------- datamodule


def test_sites_are_clients_with_foreground_slices_and_site_domains(root: Path):
    dm = NiftiSegFederated(root, image_size=8)
    assert dm.client_ids == ["hospA", "hospB", "hospC"] == dm.sites and dm.num_classes == 2
    assert dm.in_channels == 1 and dm.image_size == (8, 8)
    for i, cid in enumerate(dm.client_ids):
        d = dm.client_data(cid)
        assert len(d.train_x) == 2 * 4 and len(d.test_x) == 4  # 2 train cases, 1 test case, 4 foreground slices
        assert d.train_x.dtype == torch.float32 and d.train_x.shape[1:] == (1, 8, 8)
        assert 0 <= float(d.train_x.min()) and float(d.train_x.max()) <= 1
        assert d.train_y.dtype == torch.int64 and set(d.train_y.unique().tolist()) == {0, 1}
        assert bool((d.train_y.flatten(1).amax(1) == 1).all())  # every kept slice has foreground
        assert d.train_domain.tolist() == [i] * len(d.train_x) and d.test_domain.tolist() == [i] * len(d.test_x)
        assert dm.image_sources(cid) is None and dm.site_of(cid) == cid  # the row's name is the site already
        assert {k for _, k in dm.slice_sources(cid)} == set(FOREGROUND)
    full = NiftiSegFederated(root, image_size=16, slices="all", normalize="minmax")
    assert full.num_train_samples("hospA") == 12 and full.num_test_samples("hospA") == 6
    assert NiftiSegFederated(root, image_size=8, every_k=2).num_train_samples("hospB") == 2 * 2
    across = NiftiSegFederated(root, image_size=8, axis=0)
    assert {k for _, k in across.slice_sources("hospC", "test")} == set(range(4, 10))
    # minmax at full size: the image's voxels, scaled per volume (the first case's first slice, unresized)
    image = nib.load(str(root / "hospA" / "images" / "case0.nii.gz")).get_fdata(dtype=np.float32)
    scaled = (image - image.min()) / (image.max() - image.min())
    sources = full.slice_sources("hospA") + full.slice_sources("hospA", "test")
    d = full.client_data("hospA")
    x = torch.cat([d.train_x, d.test_x])
    at = sources.index(("case0", 0))
    np.testing.assert_allclose(x[at, 0].numpy(), scaled[:, :, 0], atol=1e-5)


def test_split_is_by_patient_and_seeded(root: Path):
    for seed in (0, 1, 2):
        dm = NiftiSegFederated(root, image_size=8, test_fraction=0.4, seed=seed)
        for cid in dm.client_ids:
            train = {c for c, _ in dm.slice_sources(cid, "train")}
            test = {c for c, _ in dm.slice_sources(cid, "test")}
            assert train and test and not train & test and train | test == {"case0", "case1", "case2"}
    a = NiftiSegFederated(root, image_size=8, seed=3)
    b = NiftiSegFederated(root, image_size=8, seed=3)
    assert a.slice_sources("hospB", "test") == b.slice_sources("hospB", "test")
    assert torch.equal(a.client_data("hospB").train_x, b.client_data("hospB").train_x)


def test_clients_per_site_deal_cases(root: Path):
    dm = NiftiSegFederated(root, image_size=8, clients_per_site=2, test_fraction=0.0)
    assert dm.client_ids == [f"{s}_{i}" for s in ("hospA", "hospB", "hospC") for i in (0, 1)]
    for site in ("hospA", "hospB", "hospC"):
        cases = [{c for c, _ in dm.slice_sources(f"{site}_{i}")} for i in (0, 1)]
        assert not cases[0] & cases[1] and cases[0] | cases[1] == {"case0", "case1", "case2"}
        assert dm.site_of(f"{site}_1") == site
        assert dm.image_sources(f"{site}_1") == ([site] * dm.num_train_samples(f"{site}_1"), "sites")
        assert dm.client_data(f"{site}_1").train_domain.unique().tolist() == [dm.sites.index(site)]
    with pytest.raises(ValueError, match=r"client 'hosp\w_\d' .* has no test slices: it has a single case"):
        NiftiSegFederated(root, image_size=8, clients_per_site=2).setup()
    with pytest.raises(ValueError, match=r"site 'hospA' has 3 case\(s\), fewer than clients_per_site=4"):
        NiftiSegFederated(root, image_size=8, clients_per_site=4).setup()


def csv_rows(root: Path, sites=("hospA", "hospB"), relative: bool = False) -> list[tuple[str, str, str, str, str]]:
    """``(image, label, site, split, case)`` per case: case0 in test; images relative to ``root`` if asked."""
    rows = []
    for site in sites:
        for c in range(3):
            ext = ".nii" if c == 2 else ".nii.gz"
            image = f"{site}/images/case{c}{ext}" if relative else f"{root}/{site}/images/case{c}{ext}"
            rows.append((image, f"{root}/{site}/labels/case{c}{ext}", site, "test" if c == 0 else "train", f"p{c}"))
    return rows


def write_csv(path: Path, header: str, rows) -> Path:
    width = len(header.split(","))
    path.write_text("\n".join([header, *(",".join(r[:width]) for r in rows)]) + "\n")
    return path


def test_csv_index_with_split_and_case_columns(root: Path, tmp_path: Path):
    # relative image paths (to the CSV's folder), absolute label paths
    index = write_csv(root / "index.csv", "image,label,site,split,case", csv_rows(root, relative=True))
    dm = NiftiSegFederated(index_csv=index, image_size=8, test_fraction=0.5)
    assert dm.client_ids == ["hospA", "hospB"] == dm.sites
    assert {c for c, _ in dm.slice_sources("hospA", "test")} == {"p0"}
    assert {c for c, _ in dm.slice_sources("hospA", "train")} == {"p1", "p2"}
    # without split/case columns: a seeded split, each row its own case
    plain = NiftiSegFederated(index_csv=write_csv(tmp_path / "plain.csv", "image,label,site", csv_rows(root)))
    assert plain.num_test_samples("hospB") == 4 and len({c for c, _ in plain.slice_sources("hospB")}) == 2
    # one patient in two rows: never split apart
    rows = [(*r[:3], "same" if r[4] in ("p1", "p2") else r[4]) for r in csv_rows(root)]
    grouped = NiftiSegFederated(index_csv=write_csv(tmp_path / "g.csv", "image,label,site,case", rows), seed=1)
    for cid in grouped.client_ids:
        test = {c for c, _ in grouped.slice_sources(cid, "test")}
        assert test in ({"p0"}, {"same"}) and not test & {c for c, _ in grouped.slice_sources(cid)}
    bad = write_csv(tmp_path / "bad.csv", "image,label,site,split", [(*csv_rows(root)[0][:3], "valid")])
    with pytest.raises(ValueError, match=r"bad\.csv line 2: split must be 'train', 'val' or 'test', got 'valid'"):
        NiftiSegFederated(index_csv=bad).setup()
    write_csv(bad, "image,label,site,split", [csv_rows(root)[0], (*csv_rows(root)[0][:3], "train")])
    with pytest.raises(ValueError, match=r"bad\.csv line 3: image .* is already listed on line 2"):
        NiftiSegFederated(index_csv=bad).setup()
    bad.write_text("image,site\nx.nii.gz,a\n")
    with pytest.raises(ValueError, match=r"bad\.csv: missing column\(s\) label"):
        NiftiSegFederated(index_csv=bad).setup()
    bad.write_text("image,label,site\nnowhere.nii.gz,nowhere.nii.gz,a\n")
    with pytest.raises(FileNotFoundError, match=r"bad\.csv line 2: image .*nowhere\.nii\.gz not found"):
        NiftiSegFederated(index_csv=bad).setup()
    bad.write_text("image,label,site\nx.nii.gz,x.nii.gz,\n")
    with pytest.raises(ValueError, match=r"bad\.csv line 2: empty 'site'"):
        NiftiSegFederated(index_csv=bad).setup()
    only_train = [(*r[:3], "train", r[4]) for r in csv_rows(root, sites=("hospA",))]
    with pytest.raises(ValueError, match=r"site 'hospA' .* has no test slices: its split column puts no case"):
        NiftiSegFederated(index_csv=write_csv(bad, "image,label,site,split", only_train)).setup()


def test_bad_inputs_name_the_file(root: Path, tmp_path: Path):
    def fails(path: Path, pattern: str, **kwargs) -> None:
        with pytest.raises(ValueError, match=pattern):
            NiftiSegFederated(path, image_size=8, **kwargs).setup()

    data = copy_tree(root, tmp_path / "d")
    site = data / "hospB"
    (site / ".DS_Store").write_text("x")
    (site / "images" / ".DS_Store").write_text("x")  # hidden: skipped
    assert NiftiSegFederated(data, image_size=8).client_ids == ["hospA", "hospB", "hospC"]
    (site / "images" / "notes.txt").write_text("x")
    fails(data, r"site 'hospB': .*images/notes\.txt is not a NIfTI volume \(a file")
    (site / "images" / "notes.txt").unlink()
    (site / "images" / "series1").mkdir()
    fails(data, r"series1 is not a NIfTI volume \(a folder.*dcm2niix")
    (site / "images" / "series1").rmdir()
    (site / "labels" / "case1.nii.gz").rename(tmp_path / "moved.nii.gz")
    fails(data, r"site 'hospB': image .*images/case1\.nii\.gz has no label")
    (tmp_path / "moved.nii.gz").rename(site / "labels" / "case1.nii.gz")
    save(site / "labels" / "case9.nii.gz", blob_label())
    fails(data, r"site 'hospB': label .*labels/case9\.nii\.gz has no image")
    (site / "labels" / "case9.nii.gz").unlink()
    save(site / "labels" / "case1.nii.gz", blob_label((16, 15, 6)))
    fails(data, r"label .*hospB/labels/case1\.nii\.gz has shape \(16, 15, 6\) but its image .*case1\.nii\.gz")
    shifted = np.eye(4)
    shifted[0, 3] = 0.5
    save(site / "labels" / "case1.nii.gz", blob_label(), shifted)
    fails(data, r"label .*hospB/labels/case1\.nii\.gz and its image .*different affines")
    save(site / "labels" / "case1.nii.gz", blob_label(), np.eye(4) + 1e-4)  # within atol: accepted
    NiftiSegFederated(data, image_size=8).setup()
    save(site / "labels" / "case1.nii.gz", blob_label() * 3)
    fails(data, r"label .*hospB/labels/case1\.nii\.gz has value 3 outside the classes \[0, 2\)")
    assert NiftiSegFederated(data, image_size=8, label_map={0: 0, 1: 1, 3: 1}).num_train_samples("hospB") == 8
    save(site / "labels" / "case1.nii.gz", blob_label())
    save(site / "images" / "case1.nii.gz", np.zeros((16, 16, 6, 2), np.float32))
    fails(data, r"images/case1\.nii\.gz is 4D with shape \(16, 16, 6, 2\); a 3D volume is expected")
    save(site / "images" / "case1.nii.gz", np.zeros((16, 16), np.float32))
    fails(data, r"images/case1\.nii\.gz is 2D")
    (site / "images" / "case1.nii.gz").write_bytes(b"not a volume")
    fails(data, r"cannot read NIfTI volume .*images/case1\.nii\.gz")
    write_case(site, "case1", seed=0)
    save(site / "images" / "case1.nii", np.zeros(SHAPE, np.float32))
    fails(data, r"site 'hospB': case 'case1' has two files")
    (site / "images" / "case1.nii").unlink()
    empty = data / "hospD"
    (empty / "images").mkdir(parents=True)
    (empty / "labels").mkdir()
    fails(data, r"site 'hospD' is empty: no \.nii/\.nii\.gz volumes in .*hospD/images")
    (empty / "labels").rmdir()
    fails(data, r"site 'hospD': missing folder .*hospD/labels")
    (empty / "images").rmdir()
    empty.rmdir()
    # a test case without foreground leaves the site with no test slices; with slices="all" it has some
    for c in range(3):
        label = np.zeros(SHAPE, np.uint8) if c == 0 else None
        write_case(site, f"case{c}", seed=c, label=label, ext=".nii" if c == 2 else ".nii.gz")
    seeds = [s for s in range(20) if "case0" in {c for c, _ in NiftiSegFederated(data, image_size=8, slices="all",
             seed=s).slice_sources("hospB", "test")}]  # fmt: skip
    fails(data, r"site 'hospB' .* has no test slices: its 1 case\(s\) have no foreground slices .*case0", seed=seeds[0])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        NiftiSegFederated(tmp_path / "nowhere").setup()


def test_argument_errors():
    with pytest.raises(ValueError, match="exactly one of root"):
        NiftiSegFederated()
    for kwargs, pattern in [
        ({"axis": 3}, "axis must be"),
        ({"slices": "some"}, "slices must be"),
        ({"every_k": 0}, "every_k must be"),
        ({"normalize": "max"}, "normalize must be"),
        ({"num_classes": 1}, "num_classes must be"),
        ({"clients_per_site": 0}, "clients_per_site must be"),
        ({"label_map": {0: 0, 1: 2}}, r"label_map maps to classes outside \[0, 2\)"),
        ({"image_size": 0}, "image_size must be"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            NiftiSegFederated("x", **kwargs)


@pytest.mark.parametrize("config", ["configs/fedavg_digits_seg.yaml", "configs/harmofl_digits_seg.yaml"])
def test_one_round_through_the_cli(root: Path, tmp_path: Path, config: str):
    from fl_lightning.cli import main

    summary = main([
        "--config", config, "--data.class_path=datamodules.NiftiSegFederated", f"--data.init_args.root={root}",
        "--data.init_args.image_size=16", "--data.init_args.label_map={0: 0, 1: 1}", "--model.init_args.width=4",
        "--model.init_args.depth=1", "--trainer.logger=false", "--trainer.accelerator=cpu", "--federation.rounds=1",
        "--federation.progress=false", f"--federation.output_dir={tmp_path}", "--federation.run_name=r",
    ])  # fmt: skip
    assert summary and (tmp_path / "r" / "summary.json").is_file() and (tmp_path / "r" / "sites.png").is_file()
    config_text = (tmp_path / "r" / "config.yaml").read_text()
    assert "NiftiSegFederated" in config_text and "num_samples" not in config_text
    assert json.loads((tmp_path / "r" / "summary.json").read_text())


def claim_shape(path: Path, shape: tuple[int, int, int]) -> None:
    """Rewrite an uncompressed NIfTI-1 header's dim[1..3] (int16 at bytes 42, 44, 46) to claim ``shape``."""
    raw = bytearray(path.read_bytes())
    raw[42:48] = np.array(shape, dtype="<i2").tobytes()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("claimed", [(2000, 2000, 2000), (1000, 1000, 1000), (64, 64, 64)])
def test_a_header_claiming_more_voxels_than_the_file_holds_is_refused_before_reading(tmp_path, claimed):
    """Failed before: 2000^3 ended in a bare MemoryError, 1000^3 filled 3.8 GB for 14 s before an error."""
    from datamodules.volumes import read_volume

    path = tmp_path / "tiny.nii"
    save(path, np.zeros((2, 2, 2), np.float32))
    claim_shape(path, claimed)
    assert path.stat().st_size < 400  # a 384-byte file
    with pytest.raises(ValueError, match=re.escape(f"tiny.nii: its header claims shape {claimed!r}")):
        read_volume(path)
    save(path, np.ones((2, 2, 2), np.float32))  # an honest header still reads
    assert read_volume(path)[0].shape == (2, 2, 2)


def test_val_rows_are_the_official_validation_split_and_a_carved_one_takes_whole_cases(root: Path, tmp_path: Path):
    rows = [(*r[:3], "val" if r[4] == "p2" else r[3], r[4]) for r in csv_rows(root)]
    official = NiftiSegFederated(index_csv=write_csv(tmp_path / "v.csv", "image,label,site,split,case", rows),
                                 image_size=8)  # fmt: skip
    assert official.has_validation
    for cid in official.client_ids:
        assert {c for c, _ in official.slice_sources(cid, "val")} == {"p2"}
        assert official.num_val_samples(cid) == len(official.slice_sources(cid, "val")) > 0
    # no split column: the carve moves whole cases (each with several slices) to validation
    carved = NiftiSegFederated(root=root, image_size=8, test_fraction=0.0, val_fraction=0.5)
    for cid in carved.client_ids:
        data = carved.client_data(cid)
        per_case = len(carved.slice_sources(cid)) // 3  # three cases, equal slice counts
        assert len(data.val_y) % per_case == 0 and 0 < len(data.val_y) < len(carved.slice_sources(cid))
        assert len(set(data.train_case.tolist())) == 3 - len(data.val_y) // per_case
