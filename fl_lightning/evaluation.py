"""Summaries of per-client evaluation results."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

# Metrics where a smaller value is better; "worst" is then the largest.
LOWER_IS_BETTER = frozenset({"loss"})


def summarise(per_client: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Mean, standard deviation (population, ddof=0) and worst client of every metric.

    Args:
        per_client: ``{client_id: {metric: value}}``.

    Returns:
        ``{metric: {"mean": …, "std": …, "worst": …, "worst_client": …}}``; ``worst_client`` is
        the id of the worst client, stored as a string.

    """
    names = sorted({m for metrics in per_client.values() for m in metrics})
    out: dict[str, dict[str, float]] = {}
    for name in names:
        items = [(cid, m[name]) for cid, m in per_client.items() if name in m and not math.isnan(m[name])]
        if not items:
            continue
        values = np.array([v for _, v in items], dtype=np.float64)
        pick = max if name in LOWER_IS_BETTER else min
        worst_cid, worst = pick(items, key=lambda kv: kv[1])
        out[name] = {
            "mean": float(values.mean()),
            "std": float(values.std()),
            "worst": float(worst),
            "worst_client": worst_cid,
        }
    return out
