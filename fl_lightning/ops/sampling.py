"""How many clients a round samples (the server's selection and DP-FedAvg's accountant use the same count)."""

from __future__ import annotations


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
