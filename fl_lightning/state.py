"""Plain containers for what the Federation holds and what clients upload."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from fl_lightning.ops.state import StateDict


@dataclass
class ModelGroup:
    """One global model and the clients that train it.

    FedAvg has one group; clustered methods (CFL, sample-clustered FL) hold several, and a client
    may belong to more than one.

    Attributes:
        name: Group name, used in metric keys and checkpoints.
        state: The group's global state dict (CPU tensors).
        members: Ids of the clients that train this group's model.
        subsets: Sample-level groups (sample-clustered FL): per member, the int64 indices of the
            training samples it trains this model on; its aggregation weight is the subset size
            n_{i,m}. ``None``: every member trains on all its samples.

    """

    name: str
    state: StateDict
    members: list[str]
    subsets: dict[str, Tensor] | None = None


@dataclass
class ClientUpdate:
    """What one client uploads after its local fit; callbacks may change it in ``on_client_end``.

    Attributes:
        client_id: The client.
        group: Name of the group it trained.
        state: The client's full state dict after training (CPU copies).
        num_samples: Training samples the client used (n_i).
        weight: Aggregation weight before normalisation (n_i, or 1 for uniform).
        num_steps: Optimiser steps taken (τ_i).
        metrics: Training metrics of the fit (``train_loss``, …).
        extras: Method-specific uploads (e.g. SCAFFOLD's control variate delta).

    """

    client_id: str
    group: str
    state: StateDict
    num_samples: int
    weight: float
    num_steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
