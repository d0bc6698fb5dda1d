"""Federated statistics as one additive vector: what a site masks for a secure sum, and the pooled sums back.

A site's summaries (:func:`fl_lightning.runtime.site_stats.split_summary`) are additive: counts, histograms, sums
and sums of squares. Laid out in one agreed order (the *layout*: ``[section, key, length]`` rows, the same on every
site, fixed by the config: classes, bins, channels or features, table columns), every site's vector can be summed
under pairwise masks (:mod:`fl_lightning.ops.secagg`) so that the server learns the pooled sums only. A split a site
lacks or withholds enters as zeros. Quartiles do not add up and have no place in it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# The additive entries of a split's summary, in layout order, and the count-like ones (integers without noise).
SPLIT_KEYS = ("n", "cases", "labels", "histogram", "sum", "sumsq", "values")
COUNT_KEYS = frozenset({"n", "cases", "labels", "histogram", "values", "rows", "columns"})
MISSING = "missing"  # the section of a table's missing cells (rows read, missing cells per column)
STATS_BITS = 16  # fraction bits of the fixed point: 2^-17 per entry and site, sums up to 2^47 / sites


def layout(
    splits: tuple[str, ...], labels: int, bins: int | None, width: int, missing_columns: list[str] | None
) -> list[list[Any]]:
    """The vector's layout: ``[section, key, length]`` rows, fixed by the data's shapes (the same on every site).

    Per split of ``splits``: n, cases (0 where a site has no case ids), ``labels`` label counts, the histogram's
    ``bins`` (images; None for tables), sums and sums of squares of ``width`` channels or columns, the values; then
    ``[missing, rows, 1]`` and ``[missing, columns, F]`` for a table's F used columns.
    """
    per_split = [("n", 1), ("cases", 1), ("labels", labels), *([("histogram", bins)] if bins is not None else []),
                 ("sum", width), ("sumsq", width), ("values", 1)]  # fmt: skip
    out = [[name, key, length] for name in splits for key, length in per_split]
    if missing_columns is not None:
        out += [[MISSING, "rows", 1], [MISSING, "columns", len(missing_columns)]]
    return out


def _as_list(value: Any) -> list[float]:
    if value is None:
        return []
    return [float(v) for v in value] if isinstance(value, list) else [float(value)]


def flatten(spec: list[list[Any]], parts: dict[str, dict[str, Any] | None]) -> Tensor:
    """One site's vector in ``spec``'s order (float64): ``parts[section][key]``.

    Zeros where a section is None (a split the site lacks or withholds) or a value is None (no case ids).

    Raises:
        ValueError: If a value's length differs from the layout's (the sites' data differ in shape).
    """
    out = []
    for section, key, length in spec:
        part = parts.get(section)
        values = [0.0] * length if part is None or part.get(key) is None else _as_list(part[key])
        if len(values) != length:
            raise ValueError(f"statistics {section}.{key} has {len(values)} entries, the layout {length}")
        out += values
    return torch.tensor(out, dtype=torch.float64)


def unflatten(spec: list[list[Any]], total: Tensor, counts_exact: bool) -> dict[str, dict[str, Any]]:
    """The pooled sums ``{section: {key: value}}`` of a summed vector.

    Count-like entries are rounded to integers when ``counts_exact`` (no noise: each site's were integers, the
    fixed point's error is far below 1/2).
    """
    out: dict[str, dict[str, Any]] = {}
    at = 0
    for section, key, length in spec:
        values = total[at : at + length].tolist()
        at += length
        if counts_exact and key in COUNT_KEYS:
            values = [int(round(v)) for v in values]
        out.setdefault(section, {})[key] = values[0] if key in ("n", "cases", "values", "rows") else values
    if at != total.numel():
        raise ValueError(f"a summed statistics vector of {total.numel()} entries, the layout {at}")
    return out


def layout_size(spec: list[list[Any]]) -> int:
    """The vector's length."""
    return sum(int(length) for _, _, length in spec)
