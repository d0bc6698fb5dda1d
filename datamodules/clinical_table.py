"""Clinical tables: feature rows of patients from several hospitals, one client per hospital.

The format hospitals' tabular data come in: CSV/TSV files (or UCI-style ``.data`` files without a header), one
file per site or one file with a site column, numeric and categorical columns, missing values. FLamby's
Fed-Heart-Disease is the preset ``flamby_heart``: ``--data.init_args.preset=flamby_heart --data.init_args.root=DIR``
on the four UCI ``processed.*.data`` files gives its centres, splits and features.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from datamodules.base import ClientSplit, FederatedDataModule
from datamodules.sampler import stable_seed
from datamodules.site_rows import site_order
from datamodules.split import split_train_test
from datamodules.table_presets import differences, resolve
from datamodules.table_rows import (
    TableRow,
    check_columns,
    drop_or_refuse_missing,
    encode_features,
    is_missing,
    missing_tally,
    number,
    read_rows,
    standardisation,
)
from datamodules.validation import with_validation

log = logging.getLogger(__name__)

_GLOB = re.compile(r"[*?\[]")
_STANDARDIZE = ("site", "pooled", "none")
_MISSING = ("drop", "error")


class ClinicalTableFederated(FederatedDataModule):
    """Tabular classification or survival from feature tables: the hospital (site) of each row is its client.

    Rows come from the ``files`` under ``root``: each file one site (named by ``site_pattern`` or the file's stem),
    or, with ``site_column``, any number of files whose rows name their site. A row's features are the
    ``feature_columns`` (default: every column except the label, site, time, event and ``drop_columns``); the
    ``categorical_columns`` among them are one-hot encoded over the categories of all files (pandas'
    ``get_dummies`` order, the first dropped with ``drop_first``); the others must be numbers. Cells in
    ``missing_values`` (and empty cells) are missing: ``missing: drop`` leaves such rows out, ``error`` refuses
    the first one. The label is a class (an integer, a text class name, or ``label_column > label_threshold``
    as class 1) or, with ``time_column`` and ``event_column``, a survival pair ``(time, event)``.

    Each site's rows are split into training and test rows: by scikit-learn's ``train_test_split`` with
    ``split_random_state`` (stratified when every class has more than two rows, FLamby's rule), else by the
    project's seeded stratified split; ``val_fraction`` then carves a validation set out of the training rows.
    Features are standardised, fitted on **training rows only**: per site with its own mean and std
    (``standardize: site``, FLamby's choice), with the pooled training rows' (``pooled``), or not at all (``none``).

    Every argument left at None takes the ``preset``'s value, else the default given here (``test_fraction`` and
    ``batch_size`` excepted: see them).

    Args:
        root: Folder of the table files.
        preset: Named settings: ``flamby_heart`` (FLamby's Fed-Heart-Disease on the UCI ``processed.*.data``).
        files: File names or glob patterns under ``root`` (default ``["*.csv"]``), in client order.
        site_pattern: A regular expression matched against each file's name; its group ``site`` (or its first
            group) names the file's site. None: the file's stem.
        site_column: Column naming each row's site; the files are then not sites.
        sites: The sites to keep, in client order (None: all; with ``site_column`` in numeric or text order).
        header: Whether each file's first line names its columns (default true).
        columns: Column names for files without a header (or to rename the header's).
        delimiter: Cell delimiter (None: a tab for ``.tsv``, else a comma).
        feature_columns: The feature columns (None: every column but the label, site, time, event and dropped ones).
        drop_columns: Columns left out (not features, and their missing values do not drop rows).
        categorical_columns: Feature columns one-hot encoded.
        drop_first: Leave each categorical column's first category out (default true: the others are independent).
        label_column: The class column (default ``label``).
        label_threshold: Make the label binary: class 1 where ``label_column`` > this, else 0 (UCI heart: 0).
        classes: Class names in label order for text labels (None: the sorted distinct names).
        time_column: Survival: the time column (with ``event_column``; ``label_column`` is then unused).
        event_column: Survival: the event column (1 event, 0 censored).
        missing: ``drop`` or ``error`` (default) for rows with a missing value in a used column.
        missing_values: Cells that mean "missing" besides the empty cell (default ``NA``, ``NaN``, ``nan``, ``?``).
        standardize: ``site`` (default), ``pooled`` or ``none``.
        std_eps: Added to every standard deviation (default 1e-9, FLamby's), so a constant column divides by it.
        test_fraction: Fraction of each site's rows held out as its test set. Not set by a preset (it is the
            base class's argument): a value other than the preset's (``flamby_heart``: 0.34) is warned about.
        split_random_state: scikit-learn's ``random_state`` for the test split (None: the project's split, seeded by
            ``seed``).
        batch_size: Training batch size; like ``test_fraction``, warned about where it differs from the preset's
            (``flamby_heart``: 4).
        eval_batch_size: Batch size of the evaluation loaders.
        val_fraction: Fraction of each site's training rows held out as its validation set.
        seed: Seed of the project's test split, the validation split and shuffling.

    Raises:
        ValueError: On an invalid argument, naming it. Data errors (a missing file or column, a bad cell, a site
            without rows) are raised when the data are first loaded, naming the file, line and column.
    """

    sample_kind = "table"

    def __init__(
        self,
        root: str | Path,
        *,
        preset: str | None = None,
        files: list[str] | None = None,
        site_pattern: str | None = None,
        site_column: str | None = None,
        sites: list[str | int] | None = None,
        header: bool | None = None,
        columns: list[str] | None = None,
        delimiter: str | None = None,
        feature_columns: list[str] | None = None,
        drop_columns: list[str] | None = None,
        categorical_columns: list[str] | None = None,
        drop_first: bool | None = None,
        label_column: str | None = None,
        label_threshold: float | None = None,
        classes: list[str] | None = None,
        time_column: str | None = None,
        event_column: str | None = None,
        missing: Literal["drop", "error"] | None = None,
        missing_values: list[str] | None = None,
        standardize: Literal["site", "pooled", "none"] | None = None,
        std_eps: float | None = None,
        test_fraction: float = 0.2,
        split_random_state: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int = 256,
        val_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        given = {k: v for k, v in locals().items() if k not in ("self", "__class__", "preset", "root")}
        opts = resolve(preset, given)
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            test_fraction=test_fraction,
            seed=seed,
            val_fraction=val_fraction,
        )
        changed = differences(preset, given)
        if changed:
            warnings.warn(f"{'; '.join(changed)}: the run does not follow the preset there", stacklevel=2)
        if opts["standardize"] not in _STANDARDIZE:
            raise ValueError(f"data.init_args.standardize must be one of {_STANDARDIZE}, got {opts['standardize']!r}")
        if opts["missing"] not in _MISSING:
            raise ValueError(f"data.init_args.missing must be one of {_MISSING}, got {opts['missing']!r}")
        if (time_column is None) != (event_column is None):
            raise ValueError("data.init_args.time_column and event_column go together: give both or neither")
        if opts["std_eps"] < 0:
            raise ValueError(f"data.init_args.std_eps must be >= 0, got {opts['std_eps']}")
        self.root = Path(root)
        self.preset = preset
        self.opts = opts
        if time_column is not None:
            self.label_kind = "survival"
        self._source = str(self.root)
        self.feature_names: list[str] = []
        self.dropped_rows: dict[str, int] = {}  # file → rows left out for a missing value
        self._missing: dict[str, dict[str, Any]] = {}  # site → rows read and missing cells per column (stats)
        self._class_names: list[str] | None = None  # text labels' names, once loaded

    # ------------------------------------------------------------------ reading
    def _files(self) -> list[Path]:
        if not self.root.is_dir():
            raise FileNotFoundError(f"data.init_args.root={self.root} is not a folder")
        out: list[Path] = []
        for entry in self.opts["files"]:
            if _GLOB.search(entry):
                found = sorted(p for p in self.root.glob(entry) if p.is_file())
                if not found:
                    raise FileNotFoundError(f"no file under {self.root} matches {entry!r} (data.init_args.files)")
                out += [p for p in found if p not in out]
            else:
                path = self.root / entry
                if not path.is_file():
                    present = ", ".join(sorted(p.name for p in self.root.iterdir())[:20]) or "nothing"
                    raise FileNotFoundError(f"table file {path} does not exist (data.init_args.files); {self.root} "
                                            f"holds: {present}")  # fmt: skip
                out.append(path)
        return out

    def _file_site(self, path: Path) -> str:
        pattern = self.opts["site_pattern"]
        if pattern is None:
            return path.stem
        match = re.fullmatch(pattern, path.name)
        if match is None:
            raise ValueError(f"{path}: its name does not match data.init_args.site_pattern={pattern!r}")
        groups = match.groupdict()
        return groups.get("site") or match.group(1)

    def _used_columns(self, names: list[str]) -> tuple[list[str], list[str]]:
        """``(feature columns, every column the data are built from)``."""
        o = self.opts
        targets = [o["time_column"], o["event_column"]] if self.label_kind == "survival" else [o["label_column"]]
        special = [c for c in (*targets, o["site_column"]) if c is not None]
        features = o["feature_columns"] or [c for c in names if c not in special and c not in o["drop_columns"]]
        return list(features), [*features, *special]

    def _read(self) -> list[tuple[str, TableRow]]:
        """``(site, row)`` of every kept row of every file, in file and line order."""
        o = self.opts
        out = []
        self._missing = {}
        for path in self._files():
            rows = read_rows(path, header=o["header"], columns=o["columns"], delimiter=o["delimiter"])
            _, used = self._used_columns(list(rows[0].cells))
            check_columns(rows, used + list(o["categorical_columns"]), path)
            self._tally_missing(rows, used)
            kept, dropped = drop_or_refuse_missing(rows, used, frozenset(o["missing_values"]), o["missing"])
            self.dropped_rows[str(path)] = dropped
            if dropped:
                log.info("%s: %d of %d rows left out for a missing value", path, dropped, len(rows))
            site = None if o["site_column"] else self._file_site(path)
            if site is not None and not kept and (o["sites"] is None or site in map(str, o["sites"])):
                # Else the site would vanish from the clients without a word.
                raise ValueError(
                    f"{path}: site {site!r} has no row left once rows with missing values are dropped ({dropped} "
                    "dropped); it needs at least 2 (one to train, one to test)"
                )
            out += [(site if site is not None else r.cells[o["site_column"]], r) for r in kept]
        if not out:
            raise ValueError(f"{self.root}: no row is left once rows with missing values are dropped")
        return out

    def _tally_missing(self, rows: list[TableRow], used: list[str]) -> None:
        """Add ``rows`` (one file's, before any is dropped) to each site's count of missing cells per used column."""
        column, tokens = self.opts["site_column"], frozenset(self.opts["missing_values"])
        by_site: dict[str, list[TableRow]] = {}
        for r in rows:  # a row whose site cell is missing belongs to no site (it is dropped, or refused)
            site = self._file_site(r.file) if column is None else r.cells[column]
            if column is None or not is_missing(site, tokens):
                by_site.setdefault(site, []).append(r)
        for site, site_rows in by_site.items():
            entry = self._missing.setdefault(site, {"rows": 0, "columns": dict.fromkeys(used, 0)})
            entry["rows"] += len(site_rows)
            for c, k in missing_tally(site_rows, used, tokens).items():
                entry["columns"][c] = entry["columns"].get(c, 0) + k

    def missing_cells(self, client_id: str) -> dict[str, Any] | None:
        """The rows read for a client's site and their missing cells per used column (federated statistics).

        Counted before ``missing: drop`` left such rows out, per column the data are built from.
        """
        self._ensure_loaded()
        entry = self._missing.get(client_id)
        return None if entry is None else {"rows": entry["rows"], "columns": dict(entry["columns"])}

    # ------------------------------------------------------------------ labels
    def _labels(self, rows: list[TableRow]) -> torch.Tensor:
        o = self.opts
        if self.label_kind == "survival":
            pairs = []
            for r in rows:
                time, event = number(r, o["time_column"]), number(r, o["event_column"])
                if time < 0 or event not in (0.0, 1.0):
                    raise ValueError(f"{r.where}: survival needs a time >= 0 and an event of 0 or 1, got "
                                     f"{o['time_column']}={time}, {o['event_column']}={event}")  # fmt: skip
                pairs.append((time, event))
            return torch.tensor(pairs, dtype=torch.float32).reshape(len(rows), 2)
        column = o["label_column"]
        if o["label_threshold"] is not None:
            return torch.tensor([int(number(r, column) > o["label_threshold"]) for r in rows], dtype=torch.int64)
        cells = [r.cells[column] for r in rows]
        if all(re.fullmatch(r"[+-]?\d+(\.0*)?", c) for c in cells):
            labels = torch.tensor([int(float(c)) for c in cells], dtype=torch.int64)
            if labels.min() < 0:
                bad = rows[int(labels.argmin())]
                raise ValueError(f"{bad.where}: label {bad.cells[column]!r} is negative (column {column!r})")
            return labels
        names = o["classes"] or sorted(set(cells))
        index = {n: i for i, n in enumerate(names)}
        for r in rows:
            if r.cells[column] not in index:
                raise ValueError(f"{r.where}: label {r.cells[column]!r} is not one of data.init_args.classes {names}")
        self._class_names = list(names)
        return torch.tensor([index[c] for c in cells], dtype=torch.int64)

    def label_names(self) -> list[str] | None:
        """Text labels' class names, in id order (None for integer labels and survival)."""
        self._ensure_loaded()
        return self._class_names

    # ------------------------------------------------------------------ splitting
    def _test_split(self, site: str, strata: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Training and test positions of one site's rows (sorted)."""
        n, fraction = len(strata), self.test_fraction
        state = self.opts["split_random_state"]
        if state is None:
            return split_train_test(np.arange(n), strata, fraction, stable_seed(self.seed, "test", site))
        from sklearn.model_selection import train_test_split  # only here: reading other data never imports it

        levels, counts = np.unique(strata, return_counts=True)
        stratify = strata if len(levels) > 1 and bool((counts > 2).all()) else None  # FLamby's rule
        train_size = round(1.0 - fraction, 12)
        train, test = train_test_split(
            np.arange(n), test_size=1.0 - train_size, train_size=train_size, random_state=state, stratify=stratify
        )
        return np.sort(train), np.sort(test)

    def _site_order(self, present: list[str]) -> list[str]:
        wanted = self.opts["sites"]
        if wanted is None:
            if self.opts["site_column"] is None:
                return list(dict.fromkeys(present))  # file order
            return site_order(present)
        names = [str(s) for s in wanted]
        unknown = [s for s in names if s not in set(present)]
        if unknown:
            raise ValueError(f"data.init_args.sites names {unknown}, not among the sites {sorted(set(present))}")
        return names

    # ------------------------------------------------------------------ loading
    def _load(self) -> list[ClientSplit]:
        o = self.opts
        rows_by_site = self._read()
        all_rows = [r for _, r in rows_by_site]
        features, _ = self._used_columns(list(all_rows[0].cells))
        # Only the categorical columns among the features: a dropped one is no feature and its missing cells were kept.
        categorical = [c for c in o["categorical_columns"] if c in features]
        x_all, self.feature_names = encode_features(all_rows, features, categorical, o["drop_first"])
        x_all_t = torch.from_numpy(x_all).to(torch.float32)  # float32 before any statistic, as FLamby's tensors
        y_all = self._labels(all_rows)
        site_of = np.array([s for s, _ in rows_by_site], dtype=object)
        raw = []
        for site in self._site_order(list(site_of)):
            index = torch.from_numpy(np.flatnonzero(site_of == site))
            x, y = x_all_t[index], y_all[index]
            strata = (y[:, 1] if self.label_kind == "survival" else y).long().numpy()
            if len(index) < 2:
                where = "; ".join(all_rows[i].where for i in index.tolist())
                raise ValueError(
                    f"site {site!r} has {len(index)} row(s) once missing values are dropped ({where}); it needs "
                    "at least 2 (one to train, one to test)"
                )
            train, test = (torch.from_numpy(p) for p in self._test_split(site, strata))
            split = ClientSplit(site, x[train], y[train], x[test], y[test])
            raw.append(with_validation(split, self.val_fraction, self.seed, self._source))
        return self._standardised(raw)

    def _standardised(self, splits: list[ClientSplit]) -> list[ClientSplit]:
        """Each split standardised with its training rows' statistics (``site``) or all sites' (``pooled``)."""
        how, eps = self.opts["standardize"], self.opts["std_eps"]
        if how == "none":
            return splits
        pooled = standardisation(torch.cat([s.train_x for s in splits]), eps) if how == "pooled" else None
        out = []
        for s in splits:
            mean, std = pooled or standardisation(s.train_x, eps)
            out.append(
                dataclasses.replace(
                    s,
                    train_x=(s.train_x - mean) / std,
                    test_x=(s.test_x - mean) / std,
                    val_x=None if s.val_x is None else (s.val_x - mean) / std,
                )
            )
        return out

    def describe(self) -> dict[str, Any]:
        """What was read: feature names, rows dropped per file, rows per client and split (loads the data)."""
        splits = self._ensure_loaded()
        return {
            "features": list(self.feature_names),
            "dropped_rows": dict(self.dropped_rows),
            "clients": {
                c: {"train": len(s.train_y), "val": len(s.val_y), "test": len(s.test_y)} for c, s in splits.items()
            },
        }
