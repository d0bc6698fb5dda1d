"""Summaries of per-client evaluation results, and the peer-to-peer node-by-node evaluation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_lightning import protocol
from fl_lightning.protocol import Task

if TYPE_CHECKING:
    from fl_lightning.state import ModelGroup
    from fl_lightning.transport import Transport

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


def evaluate_nodes(transport: Transport, group: ModelGroup, ids: list[str], round_idx: int) -> dict[str, Any]:
    """Peer-to-peer: each node's held model on each node's test set (the model travels via the relay).

    Returns:
        ``clients`` (each node's own model on its own test set as ``personal``), ``summary`` (``personal`` and
        ``cross``, every holder × test node pair) and ``node_matrix[holder][test node]``.
    """
    take = [Task(protocol.TAKE_PRIVATE, round_idx, c, group.name) for c in ids]
    held = {t.client_id: reply.state or {} for t, reply in zip(take, transport.stream(take))}
    matrix: dict[str, dict[str, dict[str, float]]] = {}
    options = {"global": True, "personal": False}
    for holder in ids:
        state = {**group.state, **held[holder]}
        tasks = [Task(protocol.EVALUATE, round_idx, t, group.name, state=state, options=options) for t in ids]
        matrix[holder] = {t.client_id: reply.metrics["global"] for t, reply in zip(tasks, transport.stream(tasks))}
    personal = {c: matrix[c][c] for c in ids}
    pairs = {f"{h}->{t}": m for h, row in matrix.items() for t, m in row.items()}
    return {
        "clients": {"personal": personal},
        "summary": {"personal": summarise(personal), "cross": summarise(pairs)},
        "node_matrix": matrix,
    }
