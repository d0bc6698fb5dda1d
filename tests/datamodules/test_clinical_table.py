"""Clinical tables: the flamby_heart preset against FLamby's rules, the generic options, and the data errors."""

from __future__ import annotations

import csv
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.model_selection import train_test_split

from datamodules import ClinicalTableFederated

# ---------------------------------------------------------------------------------------------------------------
# The flamby_heart preset on UCI-style files, against FLamby's dataset.py followed literally
# ---------------------------------------------------------------------------------------------------------------

CENTRES = {"cleveland": 0, "hungarian": 1, "switzerland": 2, "va": 3}  # FLamby's centers_number
ROWS = {"cleveland": 50, "hungarian": 40, "switzerland": 20, "va": 30}
# Cells set to "?" in kept columns, (row, column index): each drops its row, as FLamby's dropna does. Column 2 (cp)
# is categorical, 13 (num) the label.
GAPS = {
    "cleveland": [(4, 7)],
    "hungarian": [(3, 3), (7, 4), (11, 2)],
    "switzerland": [(1, 8)],
    "va": [(2, 5), (9, 6), (12, 13)],
}


def _uci_cell(value: float, floats: bool) -> str:
    """A cell as the UCI files write it: ``63.0`` in Cleveland's style, ``63`` in Hungary's."""
    return f"{value:.1f}" if floats else f"{value:g}"


def _uci_files(root: Path) -> None:
    """``processed.{centre}.data``: 14 columns, no header, UCI heart's value ranges, drawn with numpy.

    What the files exercise: "?" in the dropped columns (slope, ca, thal: rows kept) and in kept ones (rows dropped,
    :data:`GAPS`); categories written ``2.0`` (Cleveland, VA) and ``2`` (Hungary, Switzerland), one category across
    files; Switzerland with two healthy rows once its gaps are dropped (FLamby's rule does not stratify it) and a
    constant cholesterol of 0 (as in the real file), whose standard deviation is 0.
    """
    rng = np.random.default_rng(7)
    for name, n in ROWS.items():
        floats = name in ("cleveland", "va")
        columns = [
            rng.integers(29, 78, n),  # age
            rng.integers(0, 2, n),  # sex
            rng.integers(1, 5, n),  # cp (categorical)
            rng.integers(94, 201, n),  # trestbps
            np.zeros(n, dtype=int) if name == "switzerland" else rng.integers(126, 565, n),  # chol
            rng.integers(0, 2, n),  # fbs
            rng.integers(0, 3, n),  # restecg (categorical)
            rng.integers(71, 203, n),  # thalach
            rng.integers(0, 2, n),  # exang
            rng.integers(0, 63, n) / 10,  # oldpeak
            rng.integers(1, 4, n),  # slope (dropped)
            rng.integers(0, 4, n),  # ca (dropped)
            rng.choice([3, 6, 7], n),  # thal (dropped)
            rng.integers(0, 5, n),  # num
        ]
        if name == "switzerland":
            # Three healthy rows, the second of which has a gap (GAPS): two remain, so no stratification.
            columns[13] = np.array([1 + i % 4 for i in range(n)])
            columns[13][[0, 1, 6]] = 0
        cells = [[_uci_cell(float(c[i]), floats) for c in columns] for i in range(n)]
        for i in range(n):
            for j in (10, 11, 12):
                if rng.random() < 0.3:
                    cells[i][j] = "?"
        for i, j in GAPS[name]:
            cells[i][j] = "?"
        (root / f"processed.{name}.data").write_text("".join(",".join(row) + "\n" for row in cells))


def _flamby_split(nb: int, stratify: pd.Series | None) -> tuple[np.ndarray, np.ndarray]:
    """FLamby's per-centre split, its call copied."""
    return train_test_split(
        np.arange(nb), test_size=1.0 - 0.66, train_size=0.66, random_state=43, shuffle=True, stratify=stratify
    )


def _flamby_reference(root: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per centre ``(train x, train y, test x, test y)`` by FLamby's HeartDiseaseRaw/FedHeartDisease, step by step.

    Read with pandas (no header), "?" → NaN, columns 10-12 dropped, rows with NaN dropped, to_numeric; per centre
    scikit-learn's split (stratified when both classes have more than two rows); one-hot cp (2) and restecg (6) on
    all centres at once with the first category dropped; labels num > 0; per centre the float32 training rows' mean
    and unbiased std (+ 1e-9). Rows in file order within train and within test.
    """
    features, labels, centres, sets = pd.DataFrame(), pd.DataFrame(), [], []
    for center_data_file in root.glob("*.data"):
        center_name = center_data_file.name.split(".")[1]
        df = pd.read_csv(center_data_file, header=None)
        df = df.replace("?", np.nan).drop([10, 11, 12], axis=1).dropna(axis=0)
        df = df.apply(pd.to_numeric)
        center_x, center_y = df.iloc[:, :-1], df.iloc[:, -1]
        features = pd.concat((features, center_x), ignore_index=True)
        labels = pd.concat((labels, center_y), ignore_index=True)
        centres += [CENTRES[center_name]] * center_x.shape[0]
        current_labels = center_y.where(center_y == 0, 1, inplace=False)
        levels = np.unique(current_labels)
        stratify = None
        if len(levels) > 1 and all((current_labels == lev).sum() > 2 for lev in levels):
            stratify = current_labels
        _, indices_test = _flamby_split(int(center_x.shape[0]), stratify)
        sets += ["test" if i in indices_test else "train" for i in range(center_x.shape[0])]
    x = torch.from_numpy(pd.get_dummies(features, columns=[2, 6], drop_first=True).values.astype(np.float32))
    y = torch.from_numpy((labels.where(labels == 0, 1).values[:, 0]).astype(np.int64))
    centre_of, set_of = np.array(centres), np.array(sets)
    out = {}
    for name, c in CENTRES.items():
        train = torch.from_numpy(np.flatnonzero((centre_of == c) & (set_of == "train")))
        test = torch.from_numpy(np.flatnonzero((centre_of == c) & (set_of == "test")))
        mean, std = x[train].mean(axis=0), x[train].std(axis=0)
        out[name] = ((x[train] - mean) / (std + 1e-9), y[train], (x[test] - mean) / (std + 1e-9), y[test])
    return out


def test_flamby_heart_preset_gives_flambys_features_labels_and_splits(tmp_path: Path) -> None:
    """Every centre's training and test rows and labels equal FLamby's preprocessing of the same four files.

    The fixture is checked to hold what it is for: Switzerland has two healthy rows left (unstratified by FLamby's
    rule) and a stratified split of it would be another split, so a wrong stratification rule shows.
    """
    _uci_files(tmp_path)
    swiss = pd.read_csv(tmp_path / "processed.switzerland.data", header=None)
    swiss = swiss.replace("?", np.nan).drop([10, 11, 12], axis=1).dropna(axis=0).apply(pd.to_numeric)
    healthy = (swiss[13] == 0).to_numpy()
    assert healthy.sum() == 2
    assert not np.array_equal(_flamby_split(len(swiss), None)[1], _flamby_split(len(swiss), pd.Series(healthy))[1])
    expected = _flamby_reference(tmp_path)

    data = ClinicalTableFederated(tmp_path, preset="flamby_heart", test_fraction=0.34, batch_size=4)

    assert data.client_ids == list(CENTRES)
    assert data.num_features == 13 and data.num_classes == 2 and data.sample_kind == "table"
    for name, (train_x, train_y, test_x, test_y) in expected.items():
        split = data.client_data(name)
        assert len(split.train_y) + len(split.test_y) == ROWS[name] - len(GAPS[name])
        torch.testing.assert_close(split.train_x, train_x, rtol=0, atol=1e-6)
        torch.testing.assert_close(split.test_x, test_x, rtol=0, atol=1e-6)
        assert torch.equal(split.train_y, train_y) and torch.equal(split.test_y, test_y)
    # Switzerland's constant cholesterol divides 0 by 1e-9: 0 everywhere, not NaN.
    chol = data.feature_names.index("chol")
    assert torch.equal(data.client_data("switzerland").test_x[:, chol], torch.zeros(len(expected["switzerland"][3])))


# ---------------------------------------------------------------------------------------------------------------
# Generic options on small CSV files
# ---------------------------------------------------------------------------------------------------------------


def _write(path: Path, header: list[str] | None, rows: list[list[object]], delimiter: str = ",") -> Path:
    """A table file with ``header`` (None: no header line) and ``rows``."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        if header is not None:
            writer.writerow(header)
        writer.writerows(rows)
    return path


def _site_rows(site: int, n: int, first_rid: int) -> list[list[object]]:
    """Rows ``[rid, a, b, label]``: a unique row id, two numbers shifted by the site (so sites differ), 0/1 labels."""
    rng = np.random.default_rng(site)
    return [
        [first_rid + i, round(float(rng.normal(3 * site, 1 + site)), 3), round(float(rng.uniform(0, 10)), 3), i % 2]
        for i in range(n)
    ]


def _sites(root: Path, sizes: dict[str, int], suffix: str = ".csv", delimiter: str = ",") -> dict[int, list[object]]:
    """One file per site (``{site}{suffix}``) of :func:`_site_rows`; returns every row by its id."""
    by_rid: dict[int, list[object]] = {}
    for s, (site, n) in enumerate(sizes.items()):
        rows = _site_rows(s, n, first_rid=100 * s)
        _write(root / f"{site}{suffix}", ["rid", "a", "b", "label"], rows, delimiter)
        by_rid.update({int(r[0]): r for r in rows})
    return by_rid


def _rids(x: torch.Tensor) -> list[int]:
    """The row ids of unstandardised rows whose first feature is the id."""
    return x[:, 0].round().long().tolist()


def _expected_x(by_rid: dict[int, list[object]], rids: list[int], columns: list[int]) -> torch.Tensor:
    """The written values of ``columns`` (indices into the row lists) of rows ``rids``, as float32."""
    return torch.tensor([[float(by_rid[r][c]) for c in columns] for r in rids], dtype=torch.float32)


def test_site_column_gives_clients_in_numeric_order_and_rows_in_file_order(tmp_path: Path) -> None:
    """With ``site_column`` the rows of one file go to their sites (``1, 2, 10``: numeric order), in file order.

    Features default to every column but the label and the site; values and labels are the written ones.
    """
    sites = ["10", "2", "1"]
    rows = [[rid, sites[rid % 3], rid * 0.5, (rid * 7) % 5, rid // 3 % 2] for rid in range(36)]
    _write(tmp_path / "all.csv", ["rid", "site", "a", "b", "label"], rows)

    data = ClinicalTableFederated(tmp_path, site_column="site", standardize="none", test_fraction=0.25)

    assert data.client_ids == ["1", "2", "10"]
    assert data.feature_names == ["rid", "a", "b"]
    for site in data.client_ids:
        split = data.client_data(site)
        train, test = _rids(split.train_x), _rids(split.test_x)
        assert train == sorted(train) and test == sorted(test)  # file order within each split
        assert sorted(train + test) == [r[0] for r in rows if r[1] == site]
        assert len(test) == 3  # a quarter of the site's 12 rows
        for x, y, ids in ((split.train_x, split.train_y, train), (split.test_x, split.test_y, test)):
            assert torch.equal(x, torch.tensor([[float(rows[r][0]), rows[r][2], rows[r][3]] for r in ids]))
            assert y.tolist() == [rows[r][4] for r in ids]


def test_feature_columns_drop_columns_and_categories(tmp_path: Path) -> None:
    """``feature_columns`` picks and orders the features; ``drop_columns`` leaves columns out, their cells unread.

    A dropped column may hold text and missing cells (with ``missing: error``); a categorical column that is dropped
    or not among the feature columns is no feature. Categories are one-hot in sorted order, the first left out
    unless ``drop_first`` is false.
    """
    kinds = ["b", "a", "c", "a"]
    rows = [[rid, rid + 0.25, 2 * rid, "?" if rid == 3 else f"note {rid}", kinds[rid % 4], rid % 2] for rid in range(8)]
    header = ["rid", "a", "b", "note", "kind", "label"]
    _write(tmp_path / "s1.csv", header, rows)
    _write(tmp_path / "s2.csv", header, rows)
    common = {"standardize": "none", "test_fraction": 0.25, "missing": "error"}

    chosen = ClinicalTableFederated(tmp_path, feature_columns=["b", "a"], categorical_columns=["kind"], **common)
    assert chosen.num_features == 2 and chosen.feature_names == ["b", "a"]
    dropped = ClinicalTableFederated(tmp_path, drop_columns=["note", "kind"], categorical_columns=["kind"], **common)
    assert dropped.num_features == 3 and dropped.feature_names == ["rid", "a", "b"]
    one_hot = ClinicalTableFederated(tmp_path, drop_columns=["note"], categorical_columns=["kind"], **common)
    every = ClinicalTableFederated(
        tmp_path, drop_columns=["note"], categorical_columns=["kind"], drop_first=False, **common
    )
    assert one_hot.num_features == 5 and one_hot.feature_names == ["rid", "a", "b", "kind=b", "kind=c"]
    assert every.num_features == 6 and every.feature_names == ["rid", "a", "b", "kind=a", "kind=b", "kind=c"]

    split = one_hot.client_data("s1")
    for x in (split.train_x, split.test_x):
        expected = [[r, r + 0.25, 2 * r, float(kinds[r % 4] == "b"), float(kinds[r % 4] == "c")] for r in _rids(x)]
        assert torch.equal(x, torch.tensor(expected))
    # the same split (the same seed), the picked columns in the order given
    picked = chosen.client_data("s1")
    assert torch.equal(picked.test_x, torch.tensor([[2.0 * r, r + 0.25] for r in _rids(split.test_x)]))


def test_text_labels_follow_classes_or_their_sorted_names(tmp_path: Path) -> None:
    """Text labels are class ids in ``classes``' order, or in sorted order without it; ``label_names`` says which."""
    names = ["sick", "healthy", "healthy", "sick", "unsure", "healthy"]
    for site in ("s1", "s2"):
        _write(tmp_path / f"{site}.csv", ["rid", "a", "label"], [[i, i * 2, names[i]] for i in range(6)])

    sorted_names = ClinicalTableFederated(tmp_path, standardize="none", test_fraction=0.34)
    given = ClinicalTableFederated(
        tmp_path, standardize="none", test_fraction=0.34, classes=["unsure", "sick", "healthy"]
    )

    assert sorted_names.label_names() == ["healthy", "sick", "unsure"]
    assert given.label_names() == ["unsure", "sick", "healthy"] and given.num_classes == 3
    for data, order in ((sorted_names, ["healthy", "sick", "unsure"]), (given, ["unsure", "sick", "healthy"])):
        for site in data.client_ids:
            split = data.client_data(site)
            for x, y in ((split.train_x, split.train_y), (split.test_x, split.test_y)):
                assert y.tolist() == [order.index(names[r]) for r in _rids(x)]


def test_label_threshold_makes_binary_labels(tmp_path: Path) -> None:
    """``label_threshold``: class 1 where the label column is above it (a UCI ``num`` of 1-4 is disease)."""
    scores = [0, 1, 2, 3, 4, 0, 1.5, 2]
    for site in ("s1", "s2"):
        _write(tmp_path / f"{site}.csv", ["rid", "a", "num"], [[i, -i, scores[i]] for i in range(8)])

    data = ClinicalTableFederated(
        tmp_path, label_column="num", label_threshold=1.5, standardize="none", test_fraction=0.25
    )

    assert data.num_classes == 2 and data.feature_names == ["rid", "a"]
    split = data.client_data("s2")
    for x, y in ((split.train_x, split.train_y), (split.test_x, split.test_y)):
        assert y.tolist() == [int(scores[r] > 1.5) for r in _rids(x)]


def _standardised(x: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """``x`` standardised with the float32 mean and unbiased std of ``train`` (+ 1e-9)."""
    return (x - train.mean(0)) / (train.std(0) + 1e-9)


def test_standardize_none_site_and_pooled(tmp_path: Path) -> None:
    """``none`` keeps the written values; ``site`` uses each site's training rows; ``pooled`` all sites' training rows.

    The test rows are standardised with the same statistics; the sites' value ranges differ, so pooled and per-site
    statistics differ too.
    """
    by_rid = _sites(tmp_path, {"s0": 12, "s1": 15, "s2": 18})
    raw = ClinicalTableFederated(tmp_path, standardize="none", test_fraction=0.25)
    site = ClinicalTableFederated(tmp_path, test_fraction=0.25)
    pooled = ClinicalTableFederated(tmp_path, standardize="pooled", test_fraction=0.25)

    all_train = torch.cat([raw.client_data(c).train_x for c in raw.client_ids])
    for c in raw.client_ids:
        r, s, p = raw.client_data(c), site.client_data(c), pooled.client_data(c)
        for x in (r.train_x, r.test_x):
            assert torch.equal(x, _expected_x(by_rid, _rids(x), [0, 1, 2]))
        torch.testing.assert_close(s.train_x, _standardised(r.train_x, r.train_x), rtol=0, atol=1e-6)
        torch.testing.assert_close(s.test_x, _standardised(r.test_x, r.train_x), rtol=0, atol=1e-6)
        torch.testing.assert_close(p.train_x, _standardised(r.train_x, all_train), rtol=0, atol=1e-6)
        torch.testing.assert_close(p.test_x, _standardised(r.test_x, all_train), rtol=0, atol=1e-6)
        assert not torch.allclose(s.test_x, p.test_x, atol=1e-3)
        assert torch.equal(s.train_y, r.train_y) and torch.equal(p.test_y, r.test_y)


def test_val_fraction_rows_take_the_training_rows_statistics(tmp_path: Path) -> None:
    """``val_fraction`` carves validation rows out of the training rows before standardising.

    The training rows' statistics exclude the validation rows; the validation and test rows are standardised with
    them. Every row is in exactly one of train, val and test.
    """
    by_rid = _sites(tmp_path, {"s0": 20, "s1": 24})
    raw = ClinicalTableFederated(tmp_path, standardize="none", test_fraction=0.25, val_fraction=0.25, seed=3)
    data = ClinicalTableFederated(tmp_path, test_fraction=0.25, val_fraction=0.25, seed=3)

    assert data.has_validation
    for c in data.client_ids:
        r, s = raw.client_data(c), data.client_data(c)
        train, val, test = _rids(r.train_x), _rids(r.val_x), _rids(r.test_x)
        assert len(val) >= 3 and sorted(train + val + test) == sorted(k for k in by_rid if k // 100 == int(c[1]))
        torch.testing.assert_close(s.train_x, _standardised(r.train_x, r.train_x), rtol=0, atol=1e-6)
        torch.testing.assert_close(s.val_x, _standardised(r.val_x, r.train_x), rtol=0, atol=1e-6)
        torch.testing.assert_close(s.test_x, _standardised(r.test_x, r.train_x), rtol=0, atol=1e-6)
        assert torch.equal(s.val_y, r.val_y) and s.val_y.tolist() == [by_rid[k][3] for k in val]


def test_tsv_files_are_read_by_suffix(tmp_path: Path) -> None:
    """A ``.tsv`` file is split at tabs: a comma inside a cell stays in it (a text class name here)."""
    labels = ["a, early", "b, late"]
    for site in ("s1", "s2"):
        rows = [[i, i / 4, labels[i % 2]] for i in range(8)]
        _write(tmp_path / f"{site}.tsv", ["rid", "a", "label"], rows, delimiter="\t")

    data = ClinicalTableFederated(tmp_path, files=["*.tsv"], standardize="none", test_fraction=0.25)

    assert data.client_ids == ["s1", "s2"] and data.label_names() == labels
    split = data.client_data("s1")
    assert torch.equal(split.train_x, torch.tensor([[r, r / 4] for r in _rids(split.train_x)]))
    assert split.train_y.tolist() == [r % 2 for r in _rids(split.train_x)]


def test_glob_patterns_and_site_pattern_name_the_sites(tmp_path: Path) -> None:
    """Glob patterns in ``files`` pick files (sorted); ``site_pattern``'s ``site`` group names their sites.

    A file that no pattern matches is not read (``other.csv`` is not a table at all).
    """
    by_rid = _sites(tmp_path, {"site_b": 10, "site_a": 12})
    (tmp_path / "other.csv").write_text("not, a\ntable\n")

    data = ClinicalTableFederated(
        tmp_path, files=["site_*.csv"], site_pattern=r"site_(?P<site>\w+)\.csv", standardize="none", test_fraction=0.2
    )

    assert data.client_ids == ["a", "b"]
    split = data.client_data("a")
    assert sorted(_rids(split.train_x) + _rids(split.test_x)) == [k for k in by_rid if k // 100 == 1]


def test_sites_choose_and_order_the_clients(tmp_path: Path) -> None:
    """``sites`` keeps the named sites in its order; a name that is no site is refused, listing the sites."""
    by_rid = _sites(tmp_path, {"x": 8, "y": 9, "z": 10})

    data = ClinicalTableFederated(tmp_path, sites=["z", "x"], standardize="none", test_fraction=0.25)

    assert data.client_ids == ["z", "x"]
    split = data.client_data("z")
    assert sorted(_rids(split.train_x) + _rids(split.test_x)) == [k for k in by_rid if k // 100 == 2]
    with pytest.raises(ValueError, match=re.escape("data.init_args.sites names ['w'], not among the sites ['x', 'y'")):
        ClinicalTableFederated(tmp_path, sites=["w", "y"]).describe()


def test_survival_labels_from_time_and_event_columns(tmp_path: Path) -> None:
    """``time_column`` + ``event_column``: float32 (N, 2) labels ``(time, event)``, label_kind "survival".

    Neither column is a feature; the label counts count censored (0) and event (1) training rows; the class's own
    label_kind stays "class" (only this datamodule's changed).
    """
    written: dict[int, tuple[float, int]] = {}
    for s, site in enumerate(("s1", "s2")):
        rows = [[100 * s + i, i * 1.5, 2.5 * s + i / 3, (i * 1.7) % 11, int(i % 3 != 0)] for i in range(12)]
        _write(tmp_path / f"{site}.csv", ["rid", "a", "b", "time", "event"], rows)
        written.update({int(r[0]): (r[3], r[4]) for r in rows})

    data = ClinicalTableFederated(
        tmp_path, time_column="time", event_column="event", standardize="none", test_fraction=0.25
    )

    assert data.label_kind == "survival" and ClinicalTableFederated.label_kind == "class"
    assert data.num_classes == 2 and data.feature_names == ["rid", "a", "b"]  # loading fills the names
    for c in data.client_ids:
        split = data.client_data(c)
        for x, y in ((split.train_x, split.train_y), (split.test_x, split.test_y)):
            assert y.dtype == torch.float32 and y.shape == (len(x), 2)
            assert torch.equal(y, torch.tensor([written[r] for r in _rids(x)], dtype=torch.float32))
        events = [written[r][1] for r in _rids(split.train_x)]
        assert data.label_counts(c).tolist() == [events.count(0), events.count(1)]


# ---------------------------------------------------------------------------------------------------------------
# Errors: each names the file, the line and the column where there is one
# ---------------------------------------------------------------------------------------------------------------


def _two_sites(root: Path, rows: list[list[object]], header: list[str] | None = None) -> Path:
    """``good.csv`` (a valid site) and ``bad.csv`` with ``rows`` under ``header`` (default rid, a, label)."""
    header = header or ["rid", "a", "label"]
    _write(root / "good.csv", ["rid", "a", "label"], [[i, i, i % 2] for i in range(6)])
    return _write(root / "bad.csv", header, rows)


def test_missing_file_lists_the_folder(tmp_path: Path) -> None:
    """A listed file that does not exist is named, with what the folder holds."""
    _sites(tmp_path, {"s1": 6})
    (tmp_path / "notes.txt").write_text("readme")
    data = ClinicalTableFederated(tmp_path, files=["s1.csv", "s2.csv"])
    message = (
        f"table file {tmp_path / 's2.csv'} does not exist (data.init_args.files); {tmp_path} holds: notes.txt, s1.csv"
    )
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        data.describe()


def test_row_with_the_wrong_number_of_cells(tmp_path: Path) -> None:
    """A row with an extra cell: its file and line, and the columns the table has."""
    path = _two_sites(tmp_path, [[0, 1, 0], [1, 2, 1, 9], [2, 3, 0]])
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 3: 4 cells, but the table has 3 columns (rid, a")):
        ClinicalTableFederated(tmp_path).describe()


def test_non_numeric_cell_in_a_numeric_column(tmp_path: Path) -> None:
    """Text in a numeric feature column: file, line, column and cell."""
    path = _two_sites(tmp_path, [[0, 1, 0], [1, 2, 1], [2, "high", 0]])
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 4: column 'a' holds 'high', not a number")):
        ClinicalTableFederated(tmp_path).describe()


def test_missing_value_refused_or_dropped_and_counted(tmp_path: Path) -> None:
    """``missing: error`` names the file, line and column of a missing cell; ``drop`` leaves the row out, counted."""
    path = _two_sites(tmp_path, [[0, 1, 0], [1, "NA", 1], [2, 3, 0], [3, 4, 1], [4, 5, 0]])
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 3: column 'a' is missing ('NA')")):
        ClinicalTableFederated(tmp_path, missing="error").describe()

    data = ClinicalTableFederated(tmp_path, missing="drop", standardize="none", test_fraction=0.25)

    assert data.describe()["dropped_rows"] == {str(tmp_path / "bad.csv"): 1, str(tmp_path / "good.csv"): 0}
    split = data.client_data("bad")
    assert sorted(_rids(split.train_x) + _rids(split.test_x)) == [0, 2, 3, 4]


def test_column_the_file_lacks_lists_its_columns(tmp_path: Path) -> None:
    """A label, site or categorical column the config names but a file lacks: the file and the columns it has."""
    path = _two_sites(tmp_path, [[0, 1, 0], [1, 2, 1]], header=["rid", "a", "outcome"])
    with pytest.raises(ValueError, match=re.escape(f"{path}: no column 'label'; the columns are rid, a, outcome")):
        ClinicalTableFederated(tmp_path).describe()
    good = tmp_path / "good.csv"
    with pytest.raises(ValueError, match=re.escape(f"{good}: no column 'hospital'; the columns are rid, a, label")):
        ClinicalTableFederated(tmp_path, files=["good.csv"], site_column="hospital").describe()
    with pytest.raises(ValueError, match=re.escape(f"{good}: no column 'kind'; the columns are rid, a, label")):
        ClinicalTableFederated(tmp_path, files=["good.csv"], categorical_columns=["kind"]).describe()


def test_bad_arguments_name_the_key(tmp_path: Path) -> None:
    """An unknown preset (listing the known ones) or ``standardize`` value is refused when the datamodule is built."""
    with pytest.raises(ValueError, match=re.escape("data.init_args.preset='fed_heart' is not a known preset; known: ")):
        ClinicalTableFederated(tmp_path, preset="fed_heart")
    with pytest.raises(ValueError, match=re.escape("data.init_args.standardize must be one of ('site', 'pooled'")):
        ClinicalTableFederated(tmp_path, standardize="global")  # type: ignore[arg-type]


def test_label_not_among_the_classes(tmp_path: Path) -> None:
    """A text label that ``classes`` does not list: file, line and label."""
    _write(tmp_path / "s1.csv", ["rid", "a", "label"], [[i, i, ["no", "yes"][i % 2]] for i in range(4)])
    path = _write(tmp_path / "s2.csv", ["rid", "a", "label"], [[0, 1, "no"], [1, 2, "yes"], [2, 3, "maybe"]])
    with pytest.raises(
        ValueError, match=re.escape(f"{path}, line 4: label 'maybe' is not one of data.init_args.classes")
    ):
        ClinicalTableFederated(tmp_path, classes=["no", "yes"]).describe()


def test_site_with_fewer_than_two_rows(tmp_path: Path) -> None:
    """A site left one row names the site, the row's file and line; a file left no row names the file."""
    path = _two_sites(tmp_path, [[0, "?", 0], [1, 2, 1], [2, "?", 0]])
    with pytest.raises(
        ValueError, match=re.escape(f"site 'bad' has 1 row(s) once missing values are dropped ({path}, line 3)")
    ):
        ClinicalTableFederated(tmp_path, missing="drop").describe()

    _two_sites(tmp_path, [[0, "?", 0], [1, "?", 1]])
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: site 'bad' has no row left once rows with missing values")
    ):
        ClinicalTableFederated(tmp_path, missing="drop").describe()
    # a site that ``sites`` leaves out may lose every row
    assert ClinicalTableFederated(tmp_path, missing="drop", sites=["good"]).client_ids == ["good"]


def test_preset_warns_about_a_test_fraction_other_than_its_own(tmp_path: Path) -> None:
    """A test_fraction (or batch size) other than the preset's is warned about, naming the key; its own is not."""
    with pytest.warns(
        UserWarning, match=re.escape("data.init_args.test_fraction=0.2 (preset flamby_heart expects 0.34)")
    ):
        ClinicalTableFederated(tmp_path, preset="flamby_heart", batch_size=4)
    with pytest.warns(UserWarning, match=re.escape("data.init_args.batch_size=8 (preset flamby_heart expects 4)")):
        ClinicalTableFederated(tmp_path, preset="flamby_heart", test_fraction=0.34, batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClinicalTableFederated(tmp_path, preset="flamby_heart", test_fraction=0.34, batch_size=4)
