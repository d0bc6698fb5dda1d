"""A clinical table's rows: files read into cells, missing values, numbers, one-hot categories, standardisation.

Pure functions over plain Python and numpy, each error naming the file, the line and the column, so that the
datamodule (:mod:`datamodules.clinical_table`) only composes them.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class TableRow:
    """One data row of a table file: where it comes from and its cells by column name."""

    file: Path
    line: int  # 1-based line number in its file (the header, if any, is line 1)
    cells: dict[str, str]

    @property
    def where(self) -> str:
        """``file, line N`` for messages."""
        return f"{self.file}, line {self.line}"


def sniff_delimiter(path: Path) -> str:
    """The delimiter of a table file by its suffix: a tab for ``.tsv``/``.tab``, else a comma (CSV, UCI ``.data``)."""
    return "\t" if path.suffix.lower() in (".tsv", ".tab") else ","


def read_rows(path: Path, *, header: bool, columns: list[str] | None, delimiter: str | None) -> list[TableRow]:
    """Every non-empty data row of one table file, its cells named by the header or by ``columns``.

    Args:
        path: The file.
        header: Whether the first line names the columns.
        columns: Column names for a file without a header (UCI ``.data`` files), or to rename a header's columns;
            None with ``header``: the header's names.
        delimiter: Cell delimiter; None: :func:`sniff_delimiter`.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If the file is empty, a header repeats a name, neither a header nor ``columns`` names the
            columns, or a row has another number of cells than there are columns (naming the line).
    """
    if not path.is_file():
        raise FileNotFoundError(f"table file {path} does not exist")
    with path.open(newline="", encoding="utf-8-sig") as f:
        lines = list(csv.reader(f, delimiter=delimiter or sniff_delimiter(path)))
    numbered = [(i + 1, [c.strip() for c in cells]) for i, cells in enumerate(lines) if any(c.strip() for c in cells)]
    if not numbered:
        raise ValueError(f"table file {path} holds no rows")
    names = columns
    if header:
        first_line, first = numbered.pop(0)
        names = columns or first
        if columns is not None and len(columns) != len(first):
            raise ValueError(
                f"{path}, line {first_line}: the header has {len(first)} columns, columns names {len(columns)}"
            )
    if names is None:
        raise ValueError(
            f"{path}: the file has no header (header: false); name its columns with data.init_args.columns"
        )
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{path}: column names {twice} occur more than once")
    rows = []
    for line, cells in numbered:
        if len(cells) != len(names):
            raise ValueError(
                f"{path}, line {line}: {len(cells)} cells, but the table has {len(names)} columns ({', '.join(names)})"
            )
        rows.append(TableRow(path, line, dict(zip(names, cells))))
    return rows


def check_columns(rows: list[TableRow], needed: list[str], path: Path) -> None:
    """Refuse a file that lacks a column the config names, listing the columns it has."""
    if not rows:
        return
    have = list(rows[0].cells)
    missing = [c for c in needed if c not in have]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(map(repr, missing))}; the columns are {', '.join(have)}")


def is_missing(cell: str, tokens: frozenset[str]) -> bool:
    """Whether a cell is a missing value (an empty cell, or one of ``tokens`` such as ``?`` or ``NA``)."""
    return cell == "" or cell in tokens


def drop_or_refuse_missing(
    rows: list[TableRow], used: list[str], tokens: frozenset[str], policy: str
) -> tuple[list[TableRow], int]:
    """The rows without a missing value in the ``used`` columns, and how many were dropped.

    Args:
        rows: The rows.
        used: The columns the data are built from (features, label, site, time, event).
        tokens: The cells that mean "missing" besides the empty cell.
        policy: ``"drop"`` (leave such rows out) or ``"error"`` (refuse the first one).

    Raises:
        ValueError: With ``error``, for the first row with a missing value, naming file, line and column.
    """
    kept = []
    for row in rows:
        gap = next((c for c in used if is_missing(row.cells[c], tokens)), None)
        if gap is None:
            kept.append(row)
        elif policy == "error":
            raise ValueError(
                f"{row.where}: column {gap!r} is missing ({row.cells[gap]!r}); set data.init_args.missing=drop to "
                "leave rows with missing values out"
            )
    return kept, len(rows) - len(kept)


def missing_tally(rows: list[TableRow], used: list[str], tokens: frozenset[str]) -> dict[str, int]:
    """Per column of ``used``, how many of ``rows`` have a missing cell there (before any row is dropped)."""
    return {c: sum(is_missing(r.cells[c], tokens) for r in rows) for c in used}


def number(row: TableRow, column: str) -> float:
    """A numeric cell's value.

    Raises:
        ValueError: If the cell is not a finite number, naming file, line and column.
    """
    cell = row.cells[column]
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(
            f"{row.where}: column {column!r} holds {cell!r}, not a number; list the column in "
            "data.init_args.categorical_columns if it is a category, or its token in missing_values"
        ) from None
    if not math.isfinite(value):
        raise ValueError(f"{row.where}: column {column!r} holds {cell!r}, not a finite number")
    return value


def category_key(cell: str) -> str:
    """A category cell as one value whatever its spelling: ``2``, ``2.0`` and `` 2.`` are one category ``2``."""
    try:
        value = float(cell)
    except ValueError:
        return cell
    return str(int(value)) if value.is_integer() else repr(value)


def category_order(values: list[str]) -> list[str]:
    """Distinct category values in one-hot order: numerically if every value is a number (``2`` before ``10``)."""
    distinct = set(values)
    try:
        return sorted(distinct, key=lambda v: (float(v), v))
    except ValueError:
        return sorted(distinct)


def encode_features(
    rows: list[TableRow], features: list[str], categorical: list[str], drop_first: bool
) -> tuple[np.ndarray, list[str]]:
    """The feature matrix: numeric columns as they are, then each categorical column one-hot (pandas' order).

    Numeric columns come first, in ``features``' order, then the indicator columns of each categorical column in
    ``categorical``' order, its categories (cells compared as :func:`category_key`: a file's ``2`` and another's
    ``2.0`` are one category) in :func:`category_order` over **all** rows (every file's), the first left out with
    ``drop_first`` (as ``pandas.get_dummies(..., drop_first=True)`` on the numbers). Names are ``column`` and
    ``column=category``.

    Returns:
        ``(float64 array (N, F), feature names)``.

    Raises:
        ValueError: On a non-numeric cell in a numeric column (naming file, line and column).
    """
    numeric = [c for c in features if c not in categorical]
    blocks = [np.array([[number(r, c) for c in numeric] for r in rows], dtype=np.float64).reshape(len(rows), -1)]
    names = list(numeric)
    for column in categorical:
        keys = [category_key(r.cells[column]) for r in rows]
        order = category_order(keys)
        kept = order[1:] if drop_first else order
        index = {v: i for i, v in enumerate(kept)}
        block = np.zeros((len(rows), len(kept)), dtype=np.float64)
        for i, key in enumerate(keys):
            if key in index:
                block[i, index[key]] = 1.0
        blocks.append(block)
        names += [f"{column}={v}" for v in kept]
    return np.concatenate(blocks, axis=1), names


def standardisation(train: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation (unbiased, ``torch.std``) of each feature over training rows, ``eps`` added.

    float32 as the rows are, so that a table standardised here equals one standardised with the same torch
    operations elsewhere (FLamby's Fed-Heart-Disease). A single training row has no spread: its std is taken as 0.

    Returns:
        ``(mean (F,), std + eps (F,))``; apply as ``(x - mean) / std``.
    """
    mean = train.mean(0)
    std = train.std(0) if len(train) > 1 else torch.zeros_like(mean)
    return mean, std + eps
