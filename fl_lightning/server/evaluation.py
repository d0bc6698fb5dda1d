"""The server's evaluation: which model on which client's test set, and the summaries of the results."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_lightning.server.cross_site import cross_site_matrix, own_models
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import POOLED, Task

if TYPE_CHECKING:
    from fl_lightning.callback import ModelGroup, ServerView
    from fl_lightning.wire.transport import Transport

# Metrics where a smaller value is better; "worst" is then the largest.
LOWER_IS_BETTER = frozenset({"loss", "hd95"})


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


def evaluate_nodes(
    transport: Transport, group: ModelGroup, ids: list[str], round_idx: int, split: str = "test"
) -> dict[str, Any]:
    """Peer-to-peer: each node's held model on each node's ``split`` set (the model travels via the relay).

    Returns:
        ``clients`` (each node's own model on its own test set as ``personal``), ``summary`` (``personal`` and
        ``cross``, every holder × test node pair) and ``node_matrix[holder][test node]``.
    """
    models = own_models(transport, {c: group for c in ids}, ids, round_idx)
    matrix = cross_site_matrix(transport, models, ids, round_idx, split)
    personal = {c: matrix[c][c] for c in ids}
    pairs = {f"{h}->{t}": m for h, row in matrix.items() for t, m in row.items()}
    out = {
        "clients": {"personal": personal},
        "summary": {"personal": summarise(personal), "cross": summarise(pairs)},
        "node_matrix": matrix,
    }
    if split != "test":
        out["split"] = split
    return out


def serving_groups(groups: list[ModelGroup], client_ids: list[str]) -> dict[str, ModelGroup]:
    """Per client, the first group that serves it at evaluation (one pass over the groups, not one per client)."""
    out: dict[str, ModelGroup] = {}
    for group in groups:
        for cid in client_ids if POOLED in group.members else group.members:
            out.setdefault(cid, group)
    return out


def evaluate(server: ServerView, client_ids: list[str], split: str = "test") -> dict[str, Any]:
    """Evaluate on every client's ``split`` set (not only the trained ones), one ``evaluate`` task per client.

    ``global``: the client's group model. ``personal``: the group model with the client's private
    state (identical to ``global`` when nothing is private, as in FedAvg, and then not recomputed).
    ``personal_rounds_old``: for each client with a trained personal model, how many rounds ago it was trained (a
    client not selected keeps its last one; 0: trained this round).
    ``pooled``: the global model on all clients' test sets together, from what each client returns
    with its evaluation (the module's ``evaluation_parts``: test predictions for classification, additive
    counts for segmentation) — no second pass over the data. Peer-to-peer runs have no global model;
    there every node's model is evaluated on every node's test set (``node_matrix[holder][test node]``,
    summarised over all pairs as ``cross``).

    Args:
        server: The server (its groups, module, callbacks and transport).
        client_ids: The clients evaluated (``federation.eval_clients``' sample, in the data's order); per-client
            results, their summaries and the pooled metrics are over them only.
        split: ``test`` or ``val`` (the clients' validation sets).
    """
    if server.config.topology == "peer_to_peer":
        return evaluate_nodes(server.transport, server.groups[0], client_ids, server.round, split)
    per_model: dict[str, dict[str, dict[str, float]]] = {"global": {}, "personal": {}}
    pooled = (
        server.has_global_model
        and len(server.groups) == 1
        and hasattr(server.module, "evaluation_parts")
        # predictions leave a client only in a simulation; additive counts (segmentation) may always
        and (server.transport.simulation or not getattr(server.module, "pooled_parts_are_predictions", True))
    )
    parts = []
    options = {"global": server.has_global_model, "outputs": pooled, "split": split}
    serving = serving_groups(server.groups, server.data.client_ids)
    tasks = [
        Task(protocol.EVALUATE, server.round, cid, group.name, state=group.state, options=options)
        for cid in client_ids
        for group in [serving.get(cid) or server.group_of(cid)]  # group_of raises for a client of no group
    ]
    ages: dict[str, int] = {}
    for cid, reply in zip(client_ids, server.transport.stream(tasks)):
        for model in ("global", "personal"):
            if model in reply.metrics:
                per_model[model][cid] = reply.metrics[model]
        if protocol.ROUNDS_OLD in reply.metrics:
            ages[cid] = int(reply.metrics[protocol.ROUNDS_OLD])
        if pooled and reply.payloads.get("outputs"):
            parts.append(reply.payloads["outputs"])
    for cb in server.callbacks:  # e.g. cluster models with each test image routed to one of them
        for name, per_client in cb.extra_evaluation(server).items():
            per_model[name] = per_client
    out: dict[str, Any] = {
        "clients": per_model,
        "summary": {m: summarise(v) for m, v in per_model.items() if v},
    }
    if ages:  # the clients with a trained personal model: how many rounds ago it was trained
        out[protocol.ROUNDS_OLD] = ages
    if pooled and parts:
        out["pooled"] = server.module.metrics_from_parts(server.module.merge_parts(parts))
    if split != "test":
        out["split"] = split  # the records name its metrics val/... instead of eval/...
    return out
