"""Seeded choices the server makes each round: which clients train, who passes to whom."""

from __future__ import annotations

import numpy as np


def num_selected(num_clients: int, fraction: float, count: int | None) -> int:
    """How many clients train per round: ``count`` if given, else round(fraction · N), at least 1.

    Raises:
        ValueError: If ``count`` exceeds the number of clients.

    """
    if count is not None:
        if count > num_clients:
            raise ValueError(f"federation.clients_per_round={count} exceeds the {num_clients} clients in the data")
        return count
    return max(1, min(num_clients, round(fraction * num_clients)))


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
