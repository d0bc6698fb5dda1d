"""Natural site splits from a metadata table: one CSV row per image (path, label, site), one client per site.

The format of Camelyon17-WILDS' ``metadata.csv`` (the hospital in ``center``) or of ISIC 2019 by centre: the
hospital an image comes from is the client, so the shift between clients is the real one.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import re
from pathlib import Path

import numpy as np
import torch

from datamodules.assemble import client_split
from datamodules.base import ClientSplit, FederatedDataModule, check_image_args
from datamodules.image_folder import load_image
from datamodules.partition import check_clients_fit, min_samples_for_test
from datamodules.sampler import stable_seed
from datamodules.site_rows import (
    _as_int,
    _Cell,
    _is_number,
    _row,
    _template_fields,
    _values,
    site_clients,
    site_order,
)
from datamodules.split import split_train_test
from datamodules.validation import carve_validation

# Schemes that split one site over several clients (by label: a site is already one domain).
_TABLE_SCHEMES = ("iid", "dirichlet")
_LABEL_TYPES = ("auto", "integer", "string")
_TRAIN, _TEST, _VAL = 0, 1, 2  # a row's split, from split_column


_INTEGER = re.compile(r"[+-]?\d+")  # a label written as an integer (surrounding spaces stripped)


class SiteTableFederated(FederatedDataModule):
    """Classification from a metadata table: one CSV row per image, the hospital (site) of each image its client.

    Every row names an image (``image_column``, or ``path_template`` built from the row's columns), its label
    (``label_column``) and its site (``site_column``). A path is relative to the CSV's folder unless absolute.
    Client ids are the site values as text (Camelyon17-WILDS' ``center`` 0..4 gives clients ``"0"`` .. ``"4"``),
    in numeric order when every site value is an integer, else sorted, or in the order of ``sites``. With
    ``clients_per_site`` > 1 a site is split (seeded, by ``partition``) into clients ``"<site>_0"``, ...

    Labels are integers (ids, named by ``classes`` if given) or text: class names mapped to their position in
    ``classes``, else in the sorted distinct values (:attr:`class_names`). Each client's test set is its rows whose
    ``split_column`` value is in ``test_values`` (its validation set those in ``val_values``, if given; the rest
    must be in ``train_values``), else a seeded, stratified ``test_fraction`` of its rows, of its cases with
    ``case_column`` (a carved validation split then takes whole cases too). Every image's site index is its
    ``train_domain``/``test_domain``, so ``partition.png`` and ``sites.png`` show the sites.

    Every error names the file and, for a row's problem, the row: a missing CSV or column (listing the columns
    present), an image that does not exist or is not an image, a label that is not an integer where integers are
    expected or is out of range, an unknown site in ``sites``, a row without a site, a site without training or
    test rows.

    Args:
        path: The CSV file (a header row, then one row per image).
        image_column: Column holding each image's path (unused with ``path_template``).
        path_template: A ``str.format`` template building each image's path from the row's columns, e.g.
            ``"patches/patient_{patient:03d}_node_{node}/patch_patient_{patient:03d}_node_{node}_x_{x_coord}_y_{y_coord}.png"``
            (a cell keeps its text; a numeric format spec such as ``:03d`` formats it as a number); None reads
            ``image_column``.
        label_column: Column holding each image's label.
        site_column: Column holding each image's site (hospital, centre); its value becomes the client id.
        sites: The sites to keep, in client order (None: every site in the table); a value may be given as a
            number (``[0, 3]`` for Camelyon's ``center``).
        clients_per_site: Clients each site is split into (1: the site is one client).
        partition: How a site is split over its clients: ``"iid"`` or ``"dirichlet"`` (label skew, ``alpha``).
        alpha: Dirichlet concentration for ``partition: dirichlet``.
        split_column: Column holding each row's split (None: a seeded ``test_fraction`` per client).
        train_values: ``split_column`` values of the training rows (None: ``["train"]``; Camelyon17-WILDS: ``[0]``).
        test_values: ``split_column`` values of the test rows (None: ``["test"]``; Camelyon17-WILDS: ``[1]``).
        val_values: ``split_column`` values of the official validation rows (e.g. ``["val"]``): they are each
            client's validation set, and ``val_fraction`` must stay 0. None: no row is a validation row (every
            row's value is then in ``train_values`` or ``test_values``; ``val_fraction`` carves a validation set
            out of the training rows).
        case_column: Column naming each row's case (patient, slide): the seeded splits then take whole cases, so
            no case is in two of a client's sets (the test split without ``split_column``, and the validation split
            carved by ``val_fraction``). None: rows are split one by one.
        label_type: ``"integer"`` (class ids), ``"string"`` (class names) or ``"auto"`` (integers if every label
            is a number, names if none is).
        classes: Class names in label order: the names text labels are mapped to (a label not among them is an
            error), or the names of integer ids (labels then in ``[0, len(classes))``); None: the sorted distinct
            text labels, or no names for integers.
        num_classes: Number of classes for integer labels (labels must be in ``[0, num_classes)``); None infers
            max label + 1.
        max_samples_per_site: Keep at most this many rows per site, chosen at random (seeded), before anything is
            read (None: every row).
        image_size: Side to which every image is resized.
        channels: 1 (images converted to gray) or 3 (converted to RGB).
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's rows held out as its test set when there is no ``split_column``.
        val_fraction: Fraction of each client's training samples held out as its validation set
            (default 0: none; see :class:`~datamodules.base.FederatedDataModule`).
        seed: Seed for subsampling, splitting sites into clients, the train/test split and shuffling.

    Raises:
        ValueError: On an invalid argument, naming it. Data errors are raised when the data is first loaded.

    """

    def __init__(
        self,
        path: str | Path,
        *,
        image_column: str = "image",
        path_template: str | None = None,
        label_column: str = "label",
        site_column: str = "site",
        sites: list[str | int] | None = None,
        clients_per_site: int = 1,
        partition: str = "iid",
        alpha: float = 0.5,
        split_column: str | None = None,
        train_values: list[str | int] | None = None,
        test_values: list[str | int] | None = None,
        val_values: list[str | int] | None = None,
        case_column: str | None = None,
        label_type: str = "auto",
        classes: list[str] | None = None,
        num_classes: int | None = None,
        max_samples_per_site: int | None = None,
        image_size: int = 28,
        channels: int = 3,
        batch_size: int = 32,
        eval_batch_size: int = 256,
        test_fraction: float = 0.2,
        val_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            test_fraction=test_fraction,
            seed=seed,
            val_fraction=val_fraction,
        )
        check_image_args(image_size, channels)
        if clients_per_site < 1:
            raise ValueError(f"clients_per_site must be >= 1, got {clients_per_site}")
        if partition not in _TABLE_SCHEMES:
            raise ValueError(f"partition must be one of {', '.join(_TABLE_SCHEMES)} for site tables, got {partition!r}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        if label_type not in _LABEL_TYPES:
            raise ValueError(f"label_type must be one of {', '.join(_LABEL_TYPES)}, got {label_type!r}")
        if classes is not None and (not classes or len(set(classes)) != len(classes)):
            raise ValueError(f"classes must be a non-empty list of distinct names, got {classes}")
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"num_classes must be >= 1 or None, got {num_classes}")
        if classes is not None and num_classes is not None and num_classes != len(classes):
            raise ValueError(f"num_classes={num_classes} disagrees with the {len(classes)} classes {classes}")
        if max_samples_per_site is not None and max_samples_per_site < 1:
            raise ValueError(f"max_samples_per_site must be >= 1 or None, got {max_samples_per_site}")
        for name, column in (("image_column", image_column), ("label_column", label_column)):
            if not column:
                raise ValueError(f"{name} must name a column, got {column!r}")
        if not site_column:
            raise ValueError(f"site_column must name a column, got {site_column!r}")
        self._fields = _template_fields(path_template) if path_template is not None else None
        self.path = Path(path)
        self.image_column = image_column
        self.path_template = path_template
        self.label_column = label_column
        self.site_column = site_column
        self.sites = _values(sites, "sites")
        if self.sites is not None and not self.sites:
            raise ValueError("sites must name at least one site, or be None for every site")
        self.clients_per_site = clients_per_site
        self.partition = partition
        self.alpha = alpha
        self.split_column = split_column
        self.train_values = _values(train_values, "train_values") or ["train"]
        self.test_values = _values(test_values, "test_values") or ["test"]
        self.val_values = _values(val_values, "val_values") or []
        for (a, first), (b, second) in itertools.combinations(
            (("train_values", self.train_values), ("test_values", self.test_values), ("val_values", self.val_values)), 2
        ):
            both = sorted(set(first) & set(second))
            if both:
                raise ValueError(f"split values {both} are in both {a} and {b}")
        if self.val_values and split_column is None:
            raise ValueError("val_values names split_column values: set split_column too (or leave val_values None)")
        if self.val_values and val_fraction > 0:
            raise ValueError(
                f"val_values {self.val_values} are the official validation rows and val_fraction={val_fraction} "
                "would carve another validation set: keep one (val_fraction: 0 to use the official rows)"
            )
        if case_column is not None and not case_column:
            raise ValueError(f"case_column must name a column or be None, got {case_column!r}")
        self.case_column = case_column
        self.label_type = label_type
        self.classes = list(classes) if classes is not None else None
        self.max_samples_per_site = max_samples_per_site
        self.size = image_size
        self.channels = channels
        self._num_classes_arg = num_classes
        self._declared_num_classes = num_classes
        self._source = str(self.path)
        self._class_names: list[str] | None = None
        self._site_names: list[str] = []
        self._row_site = np.empty(0, dtype=np.int64)

    # ------------------------------------------------------------------------------------------- the table

    def _where(self, line: tuple[int, int]) -> str:
        return f"{self.path} {_row(line)}"

    def _read_table(self) -> tuple[list[str], list[dict[str, str]], list[tuple[int, int]]]:
        """The header, the rows and each row's line number; checks that every column used exists."""
        if not self.path.is_file():
            raise FileNotFoundError(f"metadata table not found: {self.path}")
        try:
            with open(self.path, newline="", encoding="utf-8-sig") as f:
                reader = csv.DictReader(f)
                header = list(reader.fieldnames or [])
                rows: list[dict[str, str]] = []
                lines: list[tuple[int, int]] = []  # (row, line): a quoted cell may span lines
                for row in reader:
                    rows.append(row)
                    lines.append((len(rows), reader.line_num))
        except (UnicodeDecodeError, csv.Error) as err:
            raise ValueError(f"{self.path} cannot be read as a CSV table: {err}") from None
        if not header:
            raise ValueError(f"{self.path} is empty: expected a header row naming the columns, then one row per image")
        needed = {"site_column": self.site_column, "label_column": self.label_column}
        if self._fields is None:
            needed["image_column"] = self.image_column
        else:
            needed.update({f"path_template field {{{c}}}": c for c in self._fields})
        if self.split_column is not None:
            needed["split_column"] = self.split_column
        if self.case_column is not None:
            needed["case_column"] = self.case_column
        for option, column in needed.items():
            if column not in header:
                present = ", ".join(repr(c) for c in header)
                raise ValueError(f"{self.path} has no column {column!r} ({option}); columns present: {present}")
        if not rows:
            raise ValueError(f"{self.path} has a header but no rows")
        for row, line in zip(rows, lines, strict=True):
            if None in row or any(v is None for v in row.values()):
                cells = len(header) + len(row[None]) if None in row else sum(v is not None for v in row.values())
                raise ValueError(f"{self._where(line)} has {cells} cells but the header has {len(header)} columns")
        return header, rows, lines

    def _select_sites(self, rows: list[dict[str, str]], lines: list[tuple[int, int]]) -> tuple[list[int], list[str]]:
        """Each kept row's index and the sites in client order."""
        values = []
        for row, line in zip(rows, lines, strict=True):
            value = row[self.site_column].strip()
            if not value:
                raise ValueError(f"{self._where(line)} has no site (column {self.site_column!r} is empty)")
            values.append(value)
        present = site_order(values)
        if self.sites is None:
            names = present
        else:
            unknown = [s for s in self.sites if s not in present]
            if unknown:
                raise ValueError(
                    f"sites names {', '.join(map(repr, unknown))}, which {'has' if len(unknown) == 1 else 'have'} no "
                    f"rows in {self.path} (column "
                    f"{self.site_column!r}; sites present: {', '.join(present)})"
                )
            names = self.sites
        index = {name: i for i, name in enumerate(names)}
        kept = [r for r, v in enumerate(values) if v in index]
        self._row_site = np.array([index.get(v, -1) for v in values], dtype=np.int64)
        return kept, names

    def _labels(self, rows: list[dict[str, str]], lines: list[tuple[int, int]], kept: list[int]) -> np.ndarray:
        """Each kept row's class id; sets the class names and the declared class count."""
        column = self.label_column
        raw = [rows[r][column].strip() for r in kept]
        for r, value in zip(kept, raw, strict=True):
            if not value:
                raise ValueError(f"{self._where(lines[r])} has no label (column {column!r} is empty)")
        kind = self.label_type
        if kind == "auto":
            numeric = [_is_number(v) for v in raw]
            if all(numeric):
                kind = "integer"
            elif not any(numeric):
                kind = "string"
            else:
                num = kept[numeric.index(True)]
                text = kept[numeric.index(False)]
                raise ValueError(
                    f"{self.path}: column {column!r} mixes numbers ({_row(lines[num])}: {rows[num][column].strip()!r}) "
                    f"and text ({_row(lines[text])}: {rows[text][column].strip()!r}); fix the row, or set "
                    "label_type='string' to take every value as a class name"
                )
        if kind == "string":
            names = self.classes if self.classes is not None else sorted(set(raw))
            index = {name: i for i, name in enumerate(names)}
            for r, value in zip(kept, raw, strict=True):
                if value not in index:
                    raise ValueError(
                        f"{self._where(lines[r])}: label {value!r} (column {column!r}) is not one of the classes "
                        f"{names}"
                    )
            if self._num_classes_arg is not None and self._num_classes_arg != len(names):
                raise ValueError(
                    f"{self.path}: num_classes={self._num_classes_arg} but column {column!r} holds "
                    f"{len(names)} classes {names}"
                )
            self._class_names = list(names)
            self._declared_num_classes = len(names)
            return np.array([index[v] for v in raw], dtype=np.int64)
        labels = []
        high = len(self.classes) if self.classes is not None else self._num_classes_arg
        for r, value in zip(kept, raw, strict=True):
            label = _as_int(value)
            if label is None or not _INTEGER.fullmatch(value):  # "1e3" or "3.5" is a float, not a class id
                raise ValueError(
                    f"{self._where(lines[r])}: label {value!r} (column {column!r}) is not an integer; integer class "
                    "ids written as integers are expected ('3', not '3.0' or '1e3': a float there would make a "
                    "model of that many classes), or set label_type='string' for class names"
                )
            if label < 0 or (high is not None and label >= high):
                bound = f"[0, {high})" if high is not None else ">= 0"
                raise ValueError(
                    f"{self._where(lines[r])}: label {label} (column {column!r}) is out of range, expected {bound}"
                )
            labels.append(label)
        self._class_names = list(self.classes) if self.classes is not None else None
        if high is not None:
            self._declared_num_classes = high
        return np.array(labels, dtype=np.int64)

    def _row_splits(
        self, rows: list[dict[str, str]], lines: list[tuple[int, int]], kept: list[int]
    ) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
        """Whether each kept row is a test row and whether it is a validation row (from ``split_column``).

        Returns ``(None, None)`` without a split column.
        """
        if self.split_column is None:
            return None, None
        codes = []
        for r in kept:
            value = rows[r][self.split_column].strip()
            if value in self.test_values:
                codes.append(_TEST)
            elif value in self.val_values:
                codes.append(_VAL)
            elif value in self.train_values:
                codes.append(_TRAIN)
            else:
                val = f" nor val_values {self.val_values}" if self.val_values else ""
                raise ValueError(
                    f"{self._where(lines[r])}: split {value!r} (column {self.split_column!r}) is in neither "
                    f"train_values {self.train_values} nor test_values {self.test_values}{val}"
                )
        out = np.array(codes, dtype=np.int8)
        return out == _TEST, out == _VAL

    def _cases(self, rows: list[dict[str, str]], lines: list[tuple[int, int]], kept: list[int]) -> np.ndarray | None:
        """Each kept row's case index (``case_column``; an empty cell is an error naming the row), or None."""
        if self.case_column is None:
            return None
        values = []
        for r in kept:
            value = rows[r][self.case_column].strip()
            if not value:
                raise ValueError(f"{self._where(lines[r])} has no case (column {self.case_column!r} is empty)")
            values.append(value)
        return np.unique(np.array(values), return_inverse=True)[1].astype(np.int64)

    def _image_path(self, row: dict[str, str], line: tuple[int, int]) -> Path:
        if self.path_template is None:
            value = row[self.image_column].strip()
            if not value:
                raise ValueError(f"{self._where(line)} has no image path (column {self.image_column!r} is empty)")
        else:
            try:
                value = self.path_template.format(**{c: _Cell(row[c].strip()) for c in self._fields})
            except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
                cells = ", ".join(f"{c}={row[c]!r}" for c in self._fields)
                raise ValueError(
                    f"{self._where(line)}: path_template {self.path_template!r} cannot be filled from {cells}: {err}"
                ) from None
        path = Path(value)
        return path if path.is_absolute() else self.path.parent / path

    def _subsample(self, kept: list[int], names: list[str]) -> list[int]:
        if self.max_samples_per_site is None:
            return kept
        rows = np.asarray(kept, dtype=np.int64)
        sites = self._row_site[rows]
        out = []
        for s, name in enumerate(names):
            idx = rows[sites == s]
            if len(idx) > self.max_samples_per_site:
                rng = np.random.default_rng(stable_seed(self.seed, "subsample", name))
                idx = rng.choice(idx, size=self.max_samples_per_site, replace=False)
            out.append(idx)
        return sorted(int(r) for r in np.concatenate(out))

    # ------------------------------------------------------------------------------------------- loading

    def _load(self) -> list[ClientSplit]:
        _, rows, lines = self._read_table()
        kept, names = self._select_sites(rows, lines)
        kept = self._subsample(kept, names)
        self._site_names = list(names)
        site_index = self._row_site[np.asarray(kept, dtype=np.int64)]
        labels = self._labels(rows, lines, kept)
        is_test, is_val = self._row_splits(rows, lines, kept)
        cases = self._cases(rows, lines, kept)
        self._check_sites(site_index, is_test, is_val, names)
        paths = [self._image_path(rows[r], lines[r]) for r in kept]
        missing = [i for i, p in enumerate(paths) if not p.is_file()]
        if missing:
            first = missing[0]
            raise FileNotFoundError(
                f"{self._where(lines[kept[first]])}: image {paths[first]} does not exist ({len(missing)} of "
                f"{len(paths)} images missing; paths are relative to {self.path.parent} unless absolute)"
            )
        parts, ids = site_clients(
            site_index, labels, names, self.clients_per_site, self.partition, self.seed, alpha=self.alpha,
            source=str(self.path),
        )  # fmt: skip
        if is_test is not None:
            for cid, idx in zip(ids, parts, strict=True):
                for which, mask in (("training", ~is_test & ~is_val), ("test", is_test), ("validation", is_val)):
                    if (which != "validation" or self.val_values) and not mask[idx].any():
                        raise ValueError(
                            f"{self.path}: client {cid!r} (split out of its site, {len(idx)} rows) has no {which} "
                            "rows; use fewer clients_per_site"
                        )
        images = np.empty((len(kept), self.size, self.size, self.channels), dtype=np.uint8)
        for i, (r, file) in enumerate(zip(kept, paths, strict=True)):
            try:
                images[i] = load_image(file, self.channels, self.size)
            except ValueError as err:
                raise ValueError(f"{self._where(lines[r])}: {file} is not an image ({err.__cause__ or err})") from None
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)
        return self._splits_of(x, labels, site_index, (is_test, is_val), cases, parts, ids)

    def _check_sites(
        self, site_index: np.ndarray, is_test: np.ndarray | None, is_val: np.ndarray | None, names: list[str]
    ) -> None:
        """Every site has rows for training and for testing (and validation rows with ``val_values``)."""
        for s, name in enumerate(names):
            in_site = site_index == s
            n = int(in_site.sum())
            where = f"{self.path}: site {name!r} (column {self.site_column!r})"
            if n == 0:
                raise ValueError(f"{where} has no rows")
            if is_test is None:
                need = min_samples_for_test(self.test_fraction)
                if self.clients_per_site == 1 and n < need:
                    raise ValueError(
                        f"{where} has {n} rows, so at test_fraction={self.test_fraction} it is left without test "
                        f"samples (a site needs at least {need} rows); add rows, raise test_fraction or drop the site "
                        "(sites=[...])"
                    )
                check_clients_fit(n, self.clients_per_site, self.test_fraction, where)
                continue
            checks = [(~is_test & ~is_val, "train_values"), (is_test, "test_values")]
            checks += [(is_val, "val_values")] if self.val_values else []
            for rows_of, values in checks:
                if not rows_of[in_site].any():
                    kind = {"train_values": "training", "test_values": "test", "val_values": "validation"}[values]
                    raise ValueError(
                        f"{where} has no {kind} rows: none of its {n} rows has a {self.split_column!r} value in "
                        f"{values} {getattr(self, values)}"
                    )

    def _splits_of(
        self,
        x: torch.Tensor,
        labels: np.ndarray,
        site_index: np.ndarray,
        row_splits: tuple[np.ndarray, np.ndarray] | tuple[None, None],
        cases: np.ndarray | None,
        parts: list[np.ndarray],
        ids: list[str],
    ) -> list[ClientSplit]:
        """Each client's split: the split column's, or seeded (by whole cases with ``case_column``)."""
        out = []
        is_test, is_val = row_splits
        domain = torch.as_tensor(site_index, dtype=torch.int64)
        y = torch.as_tensor(labels, dtype=torch.int64)
        case = None if cases is None else torch.as_tensor(cases)
        for cid, idx in zip(ids, parts, strict=True):
            val = None
            if is_test is None:
                seed = stable_seed(self.seed, "split", cid)
                if case is None:
                    train, test = split_train_test(idx, labels, self.test_fraction, seed)
                else:  # whole cases: the split of carve_validation, over this client's rows
                    keep, held = carve_validation(y[idx], case[idx], self.test_fraction, seed)
                    train, test = idx[keep], idx[held]
                    if not len(test):
                        raise ValueError(
                            f"{self.path}: client {cid!r} has {len(np.unique(cases[idx]))} cases (column "
                            f"{self.case_column!r}), so at test_fraction={self.test_fraction} it is left without a "
                            "test case; raise test_fraction, add cases or drop the site (sites=[...])"
                        )
            else:
                train, test = idx[~is_test[idx] & ~is_val[idx]], idx[is_test[idx]]
                val = idx[is_val[idx]] if self.val_values else None
            split = client_split(cid, x, y, domain, train, test)
            if case is not None:  # a carved validation split takes whole cases too (datamodules.validation)
                split = dataclasses.replace(split, train_case=case[torch.as_tensor(train)])
            if val is not None:  # the official validation rows
                at = torch.as_tensor(val)
                split = dataclasses.replace(split, val_x=x[at].contiguous(), val_y=y[at], val_domain=domain[at])
            out.append(split)
        return out

    # ------------------------------------------------------------------------------------------- names

    @property
    def class_names(self) -> list[str] | None:
        """Class names in label order: ``classes``, or the sorted distinct text labels; None for unnamed ids."""
        self._ensure_loaded()
        return list(self._class_names) if self._class_names is not None else None

    def label_names(self) -> list[str] | None:
        """The classes' names (index = class id) when the table has them (:attr:`class_names`), else None."""
        return self.class_names

    @property
    def site_names(self) -> list[str]:
        """The sites in client order (index = the images' ``train_domain``/``test_domain``)."""
        self._ensure_loaded()
        return list(self._site_names)

    def image_sources(self, client_id: str) -> tuple[list[str], str]:
        """Each of the client's training images' site, for ``sites.png``.

        Args:
            client_id: One of :attr:`client_ids`.

        Returns:
            ``(the site of each training image, "sites")``.

        Raises:
            KeyError: If ``client_id`` is not one of :attr:`client_ids`.
        """
        domains = self.client_data(client_id).train_domain
        return [self._site_names[d] for d in domains.tolist()], "sites"
