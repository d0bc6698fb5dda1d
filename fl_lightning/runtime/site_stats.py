"""What a site releases of its data for federated statistics: additive summaries, small cells withheld, noise.

A ``stats`` task asks a client for summaries of its own data that the server can add up across sites: per split
the sample count, the case count, the label counts, and for images the intensity histogram and per-channel sums of
values and squares; for tables per-column sums and squares (pooled mean and std) and the site's own quartiles. The
site applies the release rules before anything leaves it:

- **min_count**: a split with fewer than ``min_count`` samples is withheld whole (only the fact is sent); a count
  cell (a class, a histogram bin) with ``0 < count < min_count`` is withheld (``None``) — the small-cell rule of
  disclosure control.
- **noise** (``epsilon``): the Gaussian mechanism, at the site, on every released number of a split; one record is
  in one split, so each split's vector is one mechanism (parallel composition: the release is (ε, δ)-DP per
  record). Each group of numbers (n, cases, labels, histogram, sums, sums of squares) is scaled by its L2
  sensitivity, computed from the data's shape (an image's pixels are in [0, 1]); table columns are unbounded, so
  with noise their sums and quartiles are withheld. The noise is drawn from a generator seeded
  by the operating system's entropy, never by the run's seed (which the server knows).
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import torch
from torch import Tensor

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


def noise_stds(summary: dict[str, Any], sample_kind: str, z: float) -> dict[str, float]:
    """The noise's std per group, σ_g = z·√k·Δ_g for k groups.

    Each group scaled to sensitivity 1, the k groups' vector has L2 sensitivity √k, so one Gaussian mechanism of
    noise z·√k on it (z: one release at (ε, δ)) is σ_g on group g.
    """
    groups = sensitivities(summary, sample_kind)
    return {g: z * math.sqrt(len(groups)) * d for g, d in groups.items()}


def noise_multiplier(epsilon: float, delta: float) -> float:
    """The noise multiplier z: noise z·Δ makes one Gaussian release (ε, δ)-DP (Opacus' PRV accountant)."""
    import numpy as np
    from opacus.accountants.utils import get_noise_multiplier

    with np.errstate(divide="ignore"):  # the PRV's log(1 − q) at q = 1 (one release of the whole split) is −inf
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=1.0, steps=1,
                                          accountant="prv"))  # fmt: skip


def _small(count: float | None, min_count: int) -> bool:
    return count is not None and 0 < count < min_count


def release(
    summary: dict[str, Any], *, min_count: int, sigma: dict[str, float] | None, sample_kind: str
) -> dict[str, Any]:
    """A split's summary as the site sends it: noised (``sigma``: the noise's std per group), small cells withheld."""
    out = dict(summary)
    if sigma is not None:
        gen = torch.Generator().manual_seed(secrets.randbits(63))
        for key, std in sigma.items():
            values = out[key] if isinstance(out[key], list) else [out[key]]
            t = torch.tensor(values, dtype=torch.float64)
            noisy = (t + std * torch.randn(t.shape, generator=gen, dtype=torch.float64)).tolist()
            out[key] = noisy if isinstance(out[key], list) else noisy[0]
        if sample_kind != "image":
            out["sum"] = out["sumsq"] = out["quantiles"] = None  # unbounded columns: no noise scale, withheld
            out["withheld_columns"] = "table columns are unbounded: with noise their sums and quartiles are withheld"
        out["noise_std"] = dict(sigma)
    if out["n"] < min_count:
        return {"withheld": f"fewer than min_count={min_count} samples"}
    if _small(out["cases"], min_count):
        out["cases"] = None
    for key in ("labels", "histogram"):
        if out.get(key) is not None:
            out[key] = [None if _small(c, min_count) else c for c in out[key]]
    return out


def strictest(asked: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The release rules a site applies: the stricter of the server's (``asked``) and its own config's.

    A larger ``min_count``, a smaller ``epsilon`` (``None``: no noise, the loosest) and ``delta``; the histogram's
    ``bins`` are the server's (small cells are withheld by ``min_count`` whatever their number). A coordinator can
    so not lower what a site releases below the floor of the site's own settings (its node config's ``fl-args``
    come after the run's overrides).
    """
    eps = [e for e in (asked.get("epsilon"), own.get("epsilon")) if e is not None]
    return {
        "min_count": max(int(asked["min_count"]), int(own["min_count"])),
        "bins": int(asked["bins"]),
        "epsilon": min(map(float, eps)) if eps else None,
        "delta": min(float(asked["delta"]), float(own["delta"])),
    }


def site_statistics(data: Any, client_id: str, options: dict[str, Any]) -> dict[str, Any]:
    """Every split's released summary of one client (``options``: ``min_count``, ``bins``, ``epsilon``, ``delta``)."""
    split = data.client_data(client_id)
    kind, label_kind = getattr(data, "sample_kind", "image"), getattr(data, "label_kind", "class")
    min_count, bins = int(options["min_count"]), int(options["bins"])
    epsilon = options.get("epsilon")
    z = None if epsilon is None else noise_multiplier(float(epsilon), float(options["delta"]))
    out: dict[str, Any] = {}
    for name in STATS_SPLITS:
        x, y = getattr(split, f"{name}_x"), getattr(split, f"{name}_y")
        if y is None or len(y) == 0:
            continue
        cases = split.train_case if name == "train" else None
        summary = split_summary(x, y, label_kind=label_kind, num_classes=data.num_classes, sample_kind=kind,
                                bins=bins, cases=cases)  # fmt: skip
        summary["mask"] = label_kind == "class" and y.ndim > 1
        sigma = None if z is None else noise_stds(summary, kind, z)
        out[name] = release(summary, min_count=min_count, sigma=sigma, sample_kind=kind)
    return out
