"""What a site releases of its data for federated statistics: additive summaries, small cells withheld, noise.

A ``stats`` task asks a client for summaries of its own data that the server can add up across sites: per split
the sample count, the case count, the label counts, and for images the intensity histogram and per-channel sums of
values and squares; for tables per-column sums and squares (pooled mean and std) and the site's own quartiles, and
the site's rows read with the missing cells per used column, counted before ``missing: drop`` left rows out. The
site applies the release rules before anything leaves it:

- **min_count**: a split with fewer than ``min_count`` samples is withheld whole (only the fact is sent); a count
  cell (a class, a histogram bin, a column's missing cells) with ``0 < count < min_count`` is withheld (``None``) —
  the small-cell rule of disclosure control.
- **noise** (``epsilon``): the Gaussian mechanism, at the site, on every released number of a split; one record is
  in one split, so each split's vector is one mechanism (parallel composition), joint with the missing cells' for a
  table: the release is (ε, δ)-DP per record. Each group of numbers (n, cases, labels, histogram, sums, sums of
  squares, rows read, missing cells) is scaled by its L2 sensitivity, computed from the data's shape (an image's
  pixels are in [0, 1]); table columns are unbounded, so with noise their sums and quartiles are withheld. The
  noise is drawn from a generator seeded by the operating system's entropy, never by the run's seed (which the
  server knows).
- **secure** (:func:`secure_parts`): the summaries go into one additive vector that the site masks for a secure
  sum (:mod:`fl_lightning.ops.stats_vector`); the server sees the pooled sums only and applies the small-cell rule
  to them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fl_lightning.ops import stats_vector
from fl_lightning.ops.disclosure import add_noise, release
from fl_lightning.ops.stats_vector import MISSING
from fl_lightning.wire.protocol import STATS_SPLITS

QUANTILES = (0.25, 0.5, 0.75)


def split_summary(x: Tensor, y: Tensor, *, label_kind: str, num_classes: int, sample_kind: str, bins: int,
                  cases: Tensor | None = None) -> dict[str, Any]:  # fmt: skip
    """Additive summaries of one split of one client (exact, before any release rule).

    Args:
        x: Images (N, C, H, W) in [0, 1], or table rows (N, F).
        y: Class ids (N,), masks (N, H, W) or survival pairs (N, 2) of (time, event).
        label_kind: ``class`` or ``survival``.
        num_classes: Classes of the labels (masks count pixels per class).
        sample_kind: ``image`` or ``table``.
        bins: Bins of the intensity histogram over [0, 1].
        cases: Case ids per sample (the number of distinct ones is reported), or None.
    """
    n = int(len(y))
    out: dict[str, Any] = {"n": n, "cases": None if cases is None else int(torch.unique(cases).numel())}
    if label_kind == "survival":
        events = int(y[:, 1].sum().item()) if n else 0
        out["labels"] = [n - events, events]  # censored, event
    else:
        out["labels"] = torch.bincount(y.reshape(-1).long(), minlength=num_classes).tolist()
    values = x.double()
    if sample_kind == "image":
        per_channel = values.transpose(0, 1).reshape(values.shape[1], -1) if n else values.new_zeros(x.shape[1], 0)
        out["shape"] = list(x.shape[1:])
        hist = torch.histc(values.reshape(-1), bins=bins, min=0.0, max=1.0) if n else torch.zeros(bins)
        out["histogram"] = hist.long().tolist()
        out["sum"] = per_channel.sum(1).tolist()
        out["sumsq"] = per_channel.square().sum(1).tolist()
        out["values"] = int(per_channel.shape[1])  # values per channel
    else:
        out["shape"] = list(x.shape[1:])
        out["sum"] = values.sum(0).tolist()
        out["sumsq"] = values.square().sum(0).tolist()
        out["values"] = n
        q = torch.quantile(values, torch.tensor(QUANTILES, dtype=torch.float64), dim=0) if n else None
        out["quantiles"] = None if q is None else {str(p): row.tolist() for p, row in zip(QUANTILES, q)}
    return out


def sensitivities(summary: dict[str, Any], sample_kind: str) -> dict[str, float]:
    """Per released group, its L2 sensitivity to adding or removing one sample (an image or a row).

    One sample changes ``n`` and ``cases`` by at most 1 and its label count by 1 (a mask: its H·W pixels, L2 at most
    H·W). An image of P = C·H·W values in [0, 1] changes the histogram by P (all in one bin at worst) and the
    per-channel sums and sums of squares by at most H·W each (L2 √C·H·W). Table columns are unbounded: none.
    """
    out = {"n": 1.0, "labels": 1.0}
    if summary.get("cases") is not None:
        out["cases"] = 1.0
    if sample_kind == "image":
        channels, *spatial = summary["shape"]
        pixels = float(math.prod(spatial))
        if summary.get("mask"):
            out["labels"] = pixels
        out.update(histogram=channels * pixels, sum=math.sqrt(channels) * pixels, sumsq=math.sqrt(channels) * pixels)
    return out


def missing_sensitivities(missing: dict[str, Any]) -> dict[str, float]:
    """A table's missing cells: one row changes the rows read by 1 and each column's count by at most 1 (L2 √F)."""
    return {"rows": 1.0, "columns": math.sqrt(len(missing["columns"]))}


def noise_stds(groups: dict[str, float], z: float, joint: int) -> dict[str, float]:
    """The noise's std per group, σ_g = z·√k·Δ_g (``groups``: g → Δ_g; k = ``joint``: the groups of a record).

    Each group scaled to sensitivity 1, the vector of the k groups a record changes (its split's and, for a table
    with missing cells, the rows read and missing counts) has L2 sensitivity √k, so one Gaussian mechanism of noise
    z·√k on it (z: one release at (ε, δ)) is σ_g on group g.
    """
    return {g: z * math.sqrt(joint) * d for g, d in groups.items()}


def noise_multiplier(epsilon: float, delta: float) -> float:
    """The noise multiplier z: noise z·Δ makes one Gaussian release (ε, δ)-DP (Opacus' PRV accountant)."""
    import numpy as np
    from opacus.accountants.utils import get_noise_multiplier

    with np.errstate(divide="ignore"):  # the PRV's log(1 − q) at q = 1 (one release of the whole split) is −inf
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=1.0, steps=1,
                                          accountant="prv"))  # fmt: skip


def strictest(asked: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The release rules a site applies: the stricter of the server's (``asked``) and its own config's.

    A larger ``min_count``, a smaller ``epsilon`` (``None``: no noise, the loosest) and ``delta``; the histogram's
    ``bins`` are the server's (small cells are withheld by ``min_count`` whatever their number); ``secure`` if
    either asks (a site that asks for it refuses to answer in the clear). A coordinator can
    so not lower what a site releases below the floor of the site's own settings (its node config's ``fl-args``
    come after the run's overrides).
    """
    eps = [e for e in (asked.get("epsilon"), own.get("epsilon")) if e is not None]
    return {
        "secure": bool(asked.get("secure")) or bool(own.get("secure")),
        "min_count": max(int(asked["min_count"]), int(own["min_count"])),
        "bins": int(asked["bins"]),
        "epsilon": min(map(float, eps)) if eps else None,
        "delta": min(float(asked["delta"]), float(own["delta"])),
    }


def summaries(data: Any, client_id: str, bins: int) -> dict[str, dict[str, Any]]:
    """Every non-empty split's exact summary of one client, in ``STATS_SPLITS`` order."""
    split = data.client_data(client_id)
    kind, label_kind = getattr(data, "sample_kind", "image"), getattr(data, "label_kind", "class")
    out = {}
    for name in STATS_SPLITS:
        x, y = getattr(split, f"{name}_x"), getattr(split, f"{name}_y")
        if y is None or len(y) == 0:
            continue
        cases = split.train_case if name == "train" else None
        out[name] = split_summary(x, y, label_kind=label_kind, num_classes=data.num_classes, sample_kind=kind,
                                  bins=bins, cases=cases)  # fmt: skip
        out[name]["mask"] = label_kind == "class" and y.ndim > 1
    return out


def missing_summary(data: Any, client_id: str) -> dict[str, Any] | None:
    """A table's rows read and missing cells per used column (``names``, ``columns``), or None.

    None for data without missing values: only a datamodule that reads them has ``missing_cells``
    (:meth:`datamodules.ClinicalTableFederated.missing_cells`).
    """
    cells = data.missing_cells(client_id) if hasattr(data, "missing_cells") else None
    if cells is None:
        return None
    return {"rows": int(cells["rows"]), "names": list(cells["columns"]), "columns": list(cells["columns"].values())}


def noise_for(
    exact: dict[str, dict[str, Any]], missing: dict[str, Any] | None, kind: str, options: dict[str, Any]
) -> tuple[dict[str, dict[str, float] | None], dict[str, float] | None]:
    """``(σ per split, σ of the missing cells)`` of the release rules ``options`` (Nones without ``epsilon``)."""
    if options.get("epsilon") is None:
        return {name: None for name in exact}, None
    z = noise_multiplier(float(options["epsilon"]), float(options["delta"]))
    of_splits = {name: sensitivities(summary, kind) for name, summary in exact.items()}
    of_missing = None if missing is None else missing_sensitivities(missing)
    extra = 0 if of_missing is None else len(of_missing)
    splits = {name: noise_stds(groups, z, len(groups) + extra) for name, groups in of_splits.items()}
    if of_missing is None:
        return splits, None
    most = max(map(len, of_splits.values()), default=0)  # a dropped row is in no split
    return splits, noise_stds(of_missing, z, len(of_missing) + most)


def site_statistics(data: Any, client_id: str, options: dict[str, Any]) -> dict[str, Any]:
    """Every split's released summary of one client, and a table's missing cells (``missing``).

    ``options``: ``min_count``, ``bins``, ``epsilon``, ``delta``.
    """
    kind, min_count = getattr(data, "sample_kind", "image"), int(options["min_count"])
    exact, missing = summaries(data, client_id, int(options["bins"])), missing_summary(data, client_id)
    sigmas, missing_sigma = noise_for(exact, missing, kind, options)
    out: dict[str, Any] = {
        name: release(summary, min_count=min_count, sigma=sigmas[name], sample_kind=kind)
        for name, summary in exact.items()
    }
    if missing is not None:
        out[MISSING] = release(missing, min_count=min_count, sigma=missing_sigma, sample_kind=kind, size_key="rows")
    return out


def secure_layout(data: Any, client_id: str, bins: int) -> list[list[Any]]:
    """The layout of a client's secure-sum vector (:func:`fl_lightning.ops.stats_vector.layout`), from its shapes."""
    return _layout(data, client_id, bins, missing_summary(data, client_id))


def _layout(data: Any, client_id: str, bins: int, missing: dict[str, Any] | None) -> list[list[Any]]:
    """:func:`secure_layout` with the client's :func:`missing_summary` already at hand."""
    x = data.client_data(client_id).train_x
    image = getattr(data, "sample_kind", "image") == "image"
    labels = 2 if getattr(data, "label_kind", "class") == "survival" else int(data.num_classes)
    return stats_vector.layout(STATS_SPLITS, labels, bins if image else None, int(x.shape[1]),
                               None if missing is None else missing["names"])  # fmt: skip


def secure_parts(data: Any, client_id: str, options: dict[str, Any]) -> tuple[list[list[Any]], Tensor, dict[str, Any]]:
    """One client's statistics for a secure sum: ``(layout, vector, flags)``.

    The same rules as :func:`site_statistics` except the small-cell rule, which the server applies to the pooled
    cells (one site's cells never reach it): a split under ``min_count`` enters as zeros and is flagged withheld,
    noise is added at the site as before, and quartiles are not sent (they do not add up). ``flags`` (in the clear)
    say per section whether it was released, whether it has case ids and whether its sums were withheld.
    """
    kind, min_count = getattr(data, "sample_kind", "image"), int(options["min_count"])
    exact, missing = summaries(data, client_id, int(options["bins"])), missing_summary(data, client_id)
    spec = _layout(data, client_id, int(options["bins"]), missing)
    sigmas, missing_sigma = noise_for(exact, missing, kind, options)
    parts: dict[str, dict[str, Any] | None] = {}
    flags: dict[str, Any] = {}
    for name in STATS_SPLITS:
        summary = exact.get(name)
        if summary is None or summary["n"] < min_count:
            parts[name] = None
            flags[name] = {"released": False, "why": "none" if summary is None else f"fewer than {min_count}"}
            continue
        sigma = sigmas[name]
        parts[name] = summary if sigma is None else add_noise(summary, sigma, kind)
        flags[name] = {"released": True, "cases": summary["cases"] is not None,
                       "sums": parts[name]["sum"] is not None}  # fmt: skip
    if missing is not None:
        released = missing["rows"] >= min_count
        noisy = missing if missing_sigma is None else add_noise(missing, missing_sigma, kind)
        parts[MISSING] = noisy if released else None
        flags[MISSING] = {"released": released, "names": missing["names"]}
    return spec, stats_vector.flatten(spec, parts), flags
