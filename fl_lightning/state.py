"""Plain containers for what the server holds (what clients send is a :class:`~fl_lightning.protocol.Reply`)."""

from __future__ import annotations

from dataclasses import dataclass

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
