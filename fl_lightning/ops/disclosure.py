"""Disclosure control of released statistics: the small-cell rule and the Gaussian noise, as pure functions.

A site applies them to its summaries before they leave it (:mod:`fl_lightning.runtime.site_stats`); with a
secure sum the server applies the small-cell rule to the pooled cells (:mod:`fl_lightning.server.secure_statistics`).
"""

from __future__ import annotations

import secrets
from typing import Any

import torch


def _small(count: float | None, min_count: int) -> bool:
    return count is not None and 0 < count < min_count


def add_noise(summary: dict[str, Any], sigma: dict[str, float], sample_kind: str) -> dict[str, Any]:
    """A summary with Gaussian noise of std ``sigma[g]`` on each group g (a table's unbounded sums withheld)."""
    out = dict(summary)
    gen = torch.Generator().manual_seed(secrets.randbits(63))
    for key, std in sigma.items():
        values = out[key] if isinstance(out[key], list) else [out[key]]
        t = torch.tensor(values, dtype=torch.float64)
        noisy = (t + std * torch.randn(t.shape, generator=gen, dtype=torch.float64)).tolist()
        out[key] = noisy if isinstance(out[key], list) else noisy[0]
    if sample_kind == "table" and "sum" in out:
        out["sum"] = out["sumsq"] = out["quantiles"] = None  # unbounded columns: no noise scale, withheld
        out["withheld_columns"] = "table columns are unbounded: with noise their sums and quartiles are withheld"
    if "values" in out and summary["n"]:  # values per channel = n · pixels: from the noisy n, else n leaks
        out["values"] = out["n"] * (summary["values"] / summary["n"])
    out["noise_std"] = dict(sigma)
    return out


def release(
    summary: dict[str, Any], *, min_count: int, sigma: dict[str, float] | None, sample_kind: str, size_key: str = "n"
) -> dict[str, Any]:
    """A summary as the site sends it: noised (``sigma``: the noise's std per group), small cells withheld.

    ``size_key`` names the count below ``min_count`` of which the whole summary is withheld (``n`` for a split).
    """
    out = dict(summary) if sigma is None else add_noise(summary, sigma, sample_kind)
    if out[size_key] < min_count:
        return {"withheld": f"fewer than min_count={min_count} samples"}
    if _small(out.get("cases"), min_count):
        out["cases"] = None
    for key in ("labels", "histogram", "columns"):
        if isinstance(out.get(key), list):
            out[key] = [None if _small(c, min_count) else c for c in out[key]]
    return out
