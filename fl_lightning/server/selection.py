"""Seeded choices the server makes each round: which clients train, who passes to whom."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fl_lightning.ops.sampling import num_selected

if TYPE_CHECKING:
    from fl_lightning.config import FederationConfig


def select_clients(client_ids: list[str], round_idx: int, seed: int, k: int) -> list[str]:
    """``k`` clients drawn without replacement, in the data's client order.

    The draw depends only on (seed, round), so a resumed run selects the same clients without any
    saved RNG state.
    """
    if k >= len(client_ids):
        return list(client_ids)
    rng = np.random.default_rng([seed, round_idx])
    chosen = set(rng.choice(len(client_ids), size=k, replace=False).tolist())
    return [cid for i, cid in enumerate(client_ids) if i in chosen]


def random_cycle(client_ids: list[str], round_idx: int, seed: int) -> dict[str, str]:
    """A fresh random cyclic order of all nodes: node → its successor (one cycle through every node)."""
    order = np.random.default_rng([seed, round_idx, 1]).permutation(len(client_ids)).tolist()
    return {client_ids[a]: client_ids[b] for a, b in zip(order, order[1:] + order[:1])}


def evaluation_sample(client_ids: list[str], round_idx: int, seed: int, eval_clients: int | float) -> list[str]:
    """The clients evaluated in round ``round_idx`` (0-based) under ``federation.eval_clients``, in the data's order.

    A float is a fraction of the clients (at least one), an int a count (at most all). The draw depends only on
    (seed, round) and uses its own stream (not client selection's), so a resumed run draws the same sample.
    """
    n = len(client_ids)
    k = max(1, round(eval_clients * n)) if isinstance(eval_clients, float) else int(eval_clients)
    if k >= n:
        return list(client_ids)
    chosen = np.random.default_rng([seed, round_idx, 2]).choice(n, size=k, replace=False)
    keep = set(chosen.tolist())
    return [cid for i, cid in enumerate(client_ids) if i in keep]


def training_clients(client_ids: list[str], round_idx: int, seed: int, config: FederationConfig) -> list[str]:
    """Clients that train in round ``round_idx``: every one without a server to sample for them, else a sample."""
    if config.mode == "local" or config.topology == "peer_to_peer":
        return list(client_ids)
    k = num_selected(len(client_ids), config.client_fraction, config.clients_per_round)
    return select_clients(client_ids, round_idx, seed, k)


def evaluated_clients(client_ids: list[str], round_idx: int, seed: int, config: FederationConfig) -> list[str]:
    """Clients evaluated in round ``round_idx``: all, or with ``eval_clients`` a seeded sample except the last round."""
    if config.eval_clients is None or round_idx + 1 >= config.rounds:
        return list(client_ids)
    return evaluation_sample(client_ids, round_idx, seed, config.eval_clients)
