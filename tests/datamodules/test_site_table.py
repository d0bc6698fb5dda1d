"""Metadata tables with natural site splits: site -> client, splits, labels, path templates, errors, one round."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules import SiteTableFederated
from fl_lightning.cli import main

SITES = {"hospA": 10, "hospB": 12, "hospC": 14}
LABELS = ["benign", "malignant", "normal"]


def _png(path: Path, row: int, site: int, size: int = 4) -> None:
    """A tiny RGB image whose red channel holds the row number and green channel the site index (read back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (row, 40 + 80 * site, 7)).save(path)


def _write_csv(path: Path, header: list[str], rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, header)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _table(root: Path, *, with_split: bool = False, sites: dict[str, int] = SITES, **columns: list) -> Path:
    """``meta.csv`` in ``root``: one row per image under ``root/images``, string labels, three sites."""
    rows = []
    for s, (site, n) in enumerate(sites.items()):
        for i in range(n):
            row = len(rows)
            name = f"images/{site}/{i}.png"
            _png(root / name, row, s)
            rows.append(
                {"image": name, "label": LABELS[row % 3], "site": site, "split": "test" if i % 4 == 0 else "train"}
            )
    for column, values in columns.items():  # overrides: one value per row
        for row, value in zip(rows, values, strict=True):
            row[column] = value
    header = ["image", "label", "site", *(["split"] if with_split else [])]
    for row in rows:
        if not with_split:
            del row["split"]
    return _write_csv(root / "meta.csv", header, rows)


def _rows(x: torch.Tensor) -> list[int]:
    """The row number each loaded image was written with."""
    return (x[:, 0, 0, 0] * 255).round().long().tolist()


def _all_rows(dm: SiteTableFederated, cid: str) -> list[int]:
    data = dm.client_data(cid)
    return _rows(data.train_x) + _rows(data.test_x)


def _site_rows(site: str) -> set[int]:
    start = sum(n for s, n in SITES.items() if list(SITES).index(s) < list(SITES).index(site))
    return set(range(start, start + SITES[site]))


def test_each_site_is_a_client_with_its_rows_labels_and_domain(tmp_path: Path) -> None:
    dm = SiteTableFederated(_table(tmp_path), image_size=4, test_fraction=0.25)
    assert dm.client_ids == ["hospA", "hospB", "hospC"] and dm.site_names == ["hospA", "hospB", "hospC"]
    assert dm.class_names == LABELS and dm.label_names() == LABELS and dm.num_classes == 3
    assert dm.in_channels == 3 and dm.image_size == (4, 4)
    for s, site in enumerate(SITES):
        data = dm.client_data(site)
        assert sorted(_all_rows(dm, site)) == sorted(_site_rows(site))
        assert len(data.test_y) == math.floor(SITES[site] * 0.25 + 0.5)
        labels = torch.cat([data.train_y, data.test_y]).tolist()
        assert labels == [LABELS.index(LABELS[r % 3]) for r in _all_rows(dm, site)]
        assert set(torch.cat([data.train_domain, data.test_domain]).tolist()) == {s}
        torch.testing.assert_close(data.train_x[:, 1], torch.full_like(data.train_x[:, 1], (40 + 80 * s) / 255))
        assert dm.image_sources(site) == ([site] * len(data.train_y), "sites")
    x = dm.client_data("hospA").train_x
    assert x.dtype == torch.float32 and x.min() >= 0 and x.max() <= 1


def test_sites_subset_order_gray_and_integer_sites(tmp_path: Path) -> None:
    dm = SiteTableFederated(_table(tmp_path), sites=["hospC", "hospA"], channels=1, image_size=6)
    assert dm.client_ids == ["hospC", "hospA"] and dm.in_channels == 1 and dm.image_size == (6, 6)
    assert set(dm.client_data("hospC").train_domain.tolist()) == {0}
    numbered = _table(tmp_path / "n", site=["10"] * 10 + ["2"] * 12 + ["0"] * 14)
    assert SiteTableFederated(numbered, image_size=4).client_ids == ["0", "2", "10"]
    assert SiteTableFederated(numbered, image_size=4, sites=[10, 0]).client_ids == ["10", "0"]


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_clients_per_site_keeps_every_sample_exactly_once(tmp_path: Path, scheme: str) -> None:
    dm = SiteTableFederated(_table(tmp_path), image_size=4, clients_per_site=2, partition=scheme, alpha=1.0)
    assert dm.client_ids == [f"{s}_{k}" for s in SITES for k in range(2)]
    seen = [r for cid in dm.client_ids for r in _all_rows(dm, cid)]
    assert sorted(seen) == list(range(sum(SITES.values())))
    for site in SITES:
        assert set(_all_rows(dm, f"{site}_0")) | set(_all_rows(dm, f"{site}_1")) == _site_rows(site)
        assert dm.image_sources(f"{site}_1")[0] == [site] * dm.num_train_samples(f"{site}_1")
    again = SiteTableFederated(_table(tmp_path), image_size=4, clients_per_site=2, partition=scheme, alpha=1.0)
    assert _all_rows(again, "hospB_0") == _all_rows(dm, "hospB_0")


def test_split_column_is_honoured(tmp_path: Path) -> None:
    dm = SiteTableFederated(_table(tmp_path, with_split=True), split_column="split", image_size=4)
    for site in SITES:
        start = min(_site_rows(site))
        test = {start + i for i in range(SITES[site]) if i % 4 == 0}
        assert set(_rows(dm.client_data(site).test_x)) == test
        assert set(_rows(dm.client_data(site).train_x)) == _site_rows(site) - test
    coded = _table(tmp_path / "c", with_split=True, split=[str(int(i % 4 == 0)) for i in range(36)])
    camelyon_style = SiteTableFederated(coded, split_column="split", train_values=[0], test_values=[1], image_size=4)
    assert set(_rows(camelyon_style.client_data("hospA").test_x)) == {0, 4, 8}


def test_test_fraction_split_is_seeded(tmp_path: Path) -> None:
    path = _table(tmp_path)

    def tests(seed: int) -> list[list[int]]:
        dm = SiteTableFederated(path, image_size=4, test_fraction=0.3, seed=seed)
        return [sorted(_rows(dm.client_data(c).test_x)) for c in dm.client_ids]

    assert tests(0) == tests(0)
    assert tests(0) != tests(1)


def test_max_samples_per_site_is_seeded(tmp_path: Path) -> None:
    path = _table(tmp_path)
    dm = SiteTableFederated(path, image_size=4, max_samples_per_site=11)
    assert [len(_all_rows(dm, c)) for c in dm.client_ids] == [10, 11, 11]
    assert set(_all_rows(dm, "hospC")) < _site_rows("hospC")
    assert _all_rows(SiteTableFederated(path, image_size=4, max_samples_per_site=11), "hospC") == _all_rows(dm, "hospC")


def test_integer_labels_named_by_classes_or_unnamed(tmp_path: Path) -> None:
    path = _table(tmp_path, label=[str(i % 2) for i in range(36)])
    dm = SiteTableFederated(path, image_size=4)
    assert dm.num_classes == 2 and dm.class_names is None and dm.label_names() is None
    named = SiteTableFederated(path, image_size=4, classes=["normal", "tumor"])
    assert named.label_names() == ["normal", "tumor"]
    assert SiteTableFederated(path, image_size=4, num_classes=4).num_classes == 4
    text = SiteTableFederated(path, image_size=4, label_type="string", classes=["1", "0"])
    assert text.client_data("hospA").train_y.tolist()[:2] == [1, 0]


def _camelyon(root: Path) -> Path:
    """A table shaped like Camelyon17-WILDS' metadata.csv (unnamed index column, tumor/center/split)."""
    header = ["", "patient", "node", "x_coord", "y_coord", "tumor", "slide", "center", "split"]
    rows = []
    for center, patient in ((0, 4), (1, 15), (3, 62)):
        for i in range(8):
            node, x, y = i % 2, 3328 + 96 * i, 21792
            name = f"patches/patient_{patient:03d}_node_{node}/patch_patient_{patient:03d}_node_{node}_x_{x}_y_{y}.png"
            _png(root / name, len(rows), center)
            values = [len(rows), patient, node, x, y, i % 2, patient * 5 + node, center, int(i >= 6)]
            rows.append(dict(zip(header, values, strict=True)))
    return _write_csv(root / "metadata.csv", header, rows)


TEMPLATE = (
    "patches/patient_{patient:03d}_node_{node}/patch_patient_{patient:03d}_node_{node}_x_{x_coord}_y_{y_coord}.png"
)


def test_path_template_reads_a_camelyon_like_table(tmp_path: Path) -> None:
    dm = SiteTableFederated(
        _camelyon(tmp_path),
        path_template=TEMPLATE,
        label_column="tumor",
        site_column="center",
        split_column="split",
        train_values=[0],
        test_values=[1],
        classes=["normal", "tumor"],
        image_size=4,
    )
    assert dm.client_ids == ["0", "1", "3"] and dm.label_names() == ["normal", "tumor"]
    assert _rows(dm.client_data("1").train_x) == list(range(8, 14))
    assert _rows(dm.client_data("1").test_x) == [14, 15]
    assert dm.client_data("3").test_y.tolist() == [0, 1]


def test_isic_like_table_with_jpegs_and_a_fold_column(tmp_path: Path) -> None:
    """FLamby's Fed-ISIC2019 split file: image names without suffix, integer targets, centres, a train/test fold."""
    rows = []
    for i in range(18):
        name = f"{i:04d}"  # leading zeros must survive the template
        Image.new("RGB", (6, 6), (i, 0, 0)).save(tmp_path / f"{name}.jpg", quality=100)
        rows.append({"image": name, "target": i % 3, "center": i % 2, "fold": "test" if i % 3 == 0 else "train"})
    path = _write_csv(tmp_path / "train_test_split", ["image", "target", "center", "fold"], rows)
    dm = SiteTableFederated(
        path, path_template="{image}.jpg", label_column="target", site_column="center", split_column="fold",
        classes=["MEL", "NV", "BCC"], image_size=6,
    )  # fmt: skip
    assert dm.client_ids == ["0", "1"] and dm.label_names() == ["MEL", "NV", "BCC"]
    assert dm.num_train_samples("0") == 6 and dm.num_test_samples("1") == 3
    assert dm.client_data("0").test_y.tolist() == [0, 0, 0]


# ------------------------------------------------------------------------------------------------------- errors


def _error(path: Path, match: str, error: type[Exception] = ValueError, **kwargs) -> None:
    with pytest.raises(error, match=match):
        SiteTableFederated(path, image_size=4, **kwargs).setup()


def test_missing_csv_and_missing_column_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "meta.csv"
    _error(missing, re.escape(str(missing)), FileNotFoundError)
    path = _table(tmp_path)
    _error(path, r"meta\.csv has no column 'center' \(site_column\); columns present: 'image', 'label', 'site'",
           site_column="center")  # fmt: skip
    _error(path, r"no column 'split' \(split_column\)", split_column="split")
    _error(path, r"no column 'patient' \(path_template field \{patient\}\).*'image'", path_template="{patient}.png")
    ragged = tmp_path / "ragged.csv"
    ragged.write_text('image,label,site\n"images/hospA/0.png",0,hospA\n"images/hospA/1.png",1\n')
    _error(ragged, r"ragged\.csv row 2 \(line 3\) has 2 cells but the header has 3 columns")


def test_missing_image_names_row_and_path(tmp_path: Path) -> None:
    path = _table(tmp_path)
    (tmp_path / "images/hospB/3.png").unlink()
    _error(path, r"meta\.csv row 14 \(line 15\): image .*hospB/3\.png does not exist \(1 of 36", FileNotFoundError)


def test_file_that_is_not_an_image_names_row_and_path(tmp_path: Path) -> None:
    path = _table(tmp_path)
    (tmp_path / "images/hospC/0.png").write_text("not a png")
    _error(path, r"meta\.csv row 23 \(line 24\): .*hospC/0\.png is not an image")


def test_unknown_site_and_a_row_without_site(tmp_path: Path) -> None:
    path = _table(tmp_path)
    _error(path, r"sites names 'hospD', which has no rows in .*meta\.csv.*sites present: hospA, hospB, hospC",
           sites=["hospA", "hospD"])  # fmt: skip
    blank = _table(tmp_path / "b", site=["hospA"] * 5 + [""] + ["hospB"] * 30)
    _error(blank, r"meta\.csv row 6 \(line 7\) has no site \(column 'site' is empty\)")


def test_bad_labels_name_the_row(tmp_path: Path) -> None:
    ints = [str(i % 2) for i in range(36)]
    path = _table(tmp_path, label=[*ints[:7], "tumour", *ints[8:]])
    _error(path, r"row 8 \(line 9\): label 'tumour' \(column 'label'\) is not an integer", label_type="integer")
    _error(path, r"column 'label' mixes numbers \(.*row 1 .*'0'\) and text \(.*row 8 .*'tumour'\)")
    half = _table(tmp_path / "h", label=[*ints[:3], "0.5", *ints[4:]])
    _error(half, r"row 4 \(line 5\): label '0.5' .* is not an integer")
    # Failed before: "1e3" read as class 1000, silently a 1001-class model; "1.0" is refused the same way
    for i, floaty in enumerate(("1e3", "1.0")):
        table = _table(tmp_path / f"f{i}", label=[*ints[:2], floaty, *ints[3:]])
        _error(table, rf"row 3 \(line 4\): label '{floaty}' .* is not an integer; .*not '3.0' or '1e3'")
    high = _table(tmp_path / "o", label=[*ints[:9], "7", *ints[10:]])
    _error(high, r"row 10 \(line 11\): label 7 \(column 'label'\) is out of range, expected \[0, 2\)", num_classes=2)
    _error(high, r"row 10 .*out of range, expected \[0, 2\)", classes=["normal", "tumor"])
    negative = _table(tmp_path / "n", label=["-1", *ints[1:]])
    _error(negative, r"row 1 \(line 2\): label -1 .*out of range, expected >= 0")
    _error(_table(tmp_path / "s"), r"row 3 .*label 'normal' .*not one of the classes", classes=["benign", "malignant"])


def test_sites_left_without_training_or_test_rows(tmp_path: Path) -> None:
    no_test = ["train" if i >= 10 and i < 22 else ("test" if i % 4 == 0 else "train") for i in range(36)]
    path = _table(tmp_path, with_split=True, split=no_test)
    _error(path, r"site 'hospB' \(column 'site'\) has no test rows: none of its 12 rows", split_column="split")
    all_test = _table(tmp_path / "t", with_split=True, split=["test"] * 10 + ["train", "test"] * 13)
    _error(all_test, r"site 'hospA' .* has no training rows", split_column="split")
    odd = _table(tmp_path / "u", with_split=True, split=["val", *["train", "test"] * 17, "train"])
    _error(odd, r"row 1 \(line 2\): split 'val' \(column 'split'\) is in neither train_values", split_column="split")
    tiny = _table(tmp_path / "s", sites={"hospA": 10, "hospB": 2, "hospC": 10})
    _error(tiny, r"site 'hospB' .* has 2 rows, so at test_fraction=0.2 it is left without test samples")
    _error(_table(tmp_path / "k"), r"site 'hospA' .*10 samples cannot give each of 4 clients", clients_per_site=4)


def test_bad_arguments_are_refused_when_built(tmp_path: Path) -> None:
    for kwargs, match in (
        ({"partition": "domain"}, "partition must be one of iid, dirichlet"),
        ({"clients_per_site": 0}, "clients_per_site must be >= 1"),
        ({"label_type": "float"}, "label_type must be one of"),
        ({"train_values": ["a"], "test_values": ["a"]}, r"split values \['a'\] are in both"),
        ({"path_template": "patches/{}.png"}, "must name its columns"),
        ({"num_classes": 3, "classes": ["a", "b"]}, "num_classes=3 disagrees"),
    ):
        with pytest.raises(ValueError, match=match):
            SiteTableFederated(tmp_path / "meta.csv", **kwargs)


# ------------------------------------------------------------------------------------------------- one round


@pytest.mark.parametrize("config", ["fedavg_digits.yaml", "harmofl_digits.yaml"])
def test_one_round_through_the_cli(tmp_path: Path, config: str) -> None:
    path = _table(tmp_path / "data", label=[str(i % 2) for i in range(36)])
    summary = main([
        "--config", f"configs/{config}", "--data.class_path=datamodules.SiteTableFederated", f"--data.path={path}",
        "--data.image_size=8", "--data.channels=3", "--model.init_args.width=4", "--trainer.logger=false",
        "--federation.rounds=1", "--federation.progress=false", f"--federation.output_dir={tmp_path / 'runs'}",
        "--federation.run_name=r",
    ])  # fmt: skip
    assert set(summary["clients"]) == set(SITES) and summary["rounds"] == 1
    assert "\n    channels: 3\n" in (tmp_path / "runs" / "r" / "config.yaml").read_text()
    assert all(np.isfinite(m["global"]["loss"]) for m in summary["clients"].values())
    assert (tmp_path / "runs" / "r" / "sites.png").is_file()


def test_val_values_are_each_clients_official_validation_rows(tmp_path: Path) -> None:
    split = ["test" if i % 4 == 0 else "val" if i % 4 == 1 else "train" for n in SITES.values() for i in range(n)]
    path = _table(tmp_path, with_split=True, split=split)
    dm = SiteTableFederated(path, split_column="split", val_values=["val"], image_size=4)
    assert dm.has_validation
    for site in SITES:
        start, data = min(_site_rows(site)), dm.client_data(site)
        val = {start + i for i in range(SITES[site]) if i % 4 == 1}
        test = {start + i for i in range(SITES[site]) if i % 4 == 0}
        assert set(_rows(data.val_x)) == val and set(_rows(data.test_x)) == test
        assert set(_rows(data.train_x)) == _site_rows(site) - val - test
        assert data.val_domain.unique().tolist() == [list(SITES).index(site)]
    assert dm.num_val_samples(site) == len(val)
    # val rows without val_values
    _error(path, "split 'val' .* in neither train_values .* nor test_values", split_column="split")


def test_val_values_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="val_fraction=0.2 would carve another validation set"):
        SiteTableFederated(tmp_path / "m.csv", split_column="split", val_values=["val"], val_fraction=0.2)
    with pytest.raises(ValueError, match="set split_column too"):
        SiteTableFederated(tmp_path / "m.csv", val_values=["val"])
    with pytest.raises(ValueError, match=r"split values \['train'\] are in both train_values and val_values"):
        SiteTableFederated(tmp_path / "m.csv", split_column="split", val_values=["train"])
    split = ["test" if i % 4 == 0 else "val" if i % 4 == 1 and n != 12 else "train"
             for n in SITES.values() for i in range(n)]  # fmt: skip
    path = _table(tmp_path, with_split=True, split=split)
    _error(path, r"site 'hospB' .* has no validation rows: .* val_values \['val'\]", split_column="split",
           val_values=["val"])  # fmt: skip


def test_case_column_keeps_each_case_in_one_set(tmp_path: Path) -> None:
    cases = [f"{site}-p{i // 3}" for site, n in SITES.items() for i in range(n)]  # three images per patient
    path = _table(tmp_path)
    text = path.read_text().splitlines()  # _table writes only its own columns: add the patient column
    rows = [line + f",{case}" for line, case in zip(text[1:], cases, strict=True)]
    path.write_text("\n".join([text[0] + ",patient", *rows]) + "\n")
    dm = SiteTableFederated(path, case_column="patient", test_fraction=0.25, val_fraction=0.25, image_size=4)
    for site in SITES:
        data = dm.client_data(site)
        sets = [{cases[r] for r in _rows(part)} for part in (data.train_x, data.val_x, data.test_x)]
        assert all(sets) and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
        assert sum(len(s) for s in sets) == math.ceil(SITES[site] / 3)  # every case in exactly one set
    plain = SiteTableFederated(_table(tmp_path / "p"), test_fraction=0.25, val_fraction=0.25, image_size=4)
    mixed = [{cases[r] for r in _rows(plain.client_data(s).test_x)}
             & {cases[r] for r in _rows(plain.client_data(s).train_x)} for s in SITES]  # fmt: skip
    assert any(mixed)  # without the case column, rows are split one by one: cases do straddle the sets
    path.write_text(path.read_text().replace(",hospA-p0\n", ",\n", 1))
    _error(path, r"meta.csv row 1 .* has no case \(column 'patient' is empty\)", case_column="patient")
