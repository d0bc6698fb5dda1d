"""Clustered FL (Sattler et al.): split a cluster of clients when their updates disagree."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import trainable_names
from fl_lightning.ops.cfl import bipartition, flatten, split_criterion

if TYPE_CHECKING:
    from fl_lightning.callback import ServerView
    from fl_lightning.wire.protocol import Reply, Task


class ClusteredFL(FederatedCallback):
    """CFL: FedAvg inside each cluster (a model group), clusters split when their clients disagree.

    After a round, a cluster whose mean update is small (‖Σ p_i Δ_i‖ < ε₁) while some client's update
    is large (max ‖Δ_i‖ > ε₂) is bipartitioned by complete-linkage clustering of the cosine
    similarities of its clients' updates; each half continues from the cluster's model. A server-only
    method: the server reads the replies' states; the clients' private states follow them into their new
    cluster (a ``regroup`` task to each member).

    With ``split_round`` set, every cluster is instead bipartitioned once, at the end of that round
    (1-based), whatever the criterion says. Clients whose updates all point the same way are never
    split. Clients of a cluster that were not sampled in the splitting round join the larger half.

    Args:
        eps1: Threshold on the norm of the weighted mean update.
        eps2: Threshold on the largest client update norm.
        split_round: Split at the end of this round instead of using the criterion.
        max_clusters: Never create more clusters than this.
    """

    def __init__(self, eps1: float = 0.4, eps2: float = 1.6, split_round: int | None = None, max_clusters: int = 8):
        super().__init__()
        self.eps1, self.eps2, self.split_round, self.max_clusters = eps1, eps2, split_round, max_clusters
        self._updates: dict[str, dict[str, tuple[torch.Tensor, float]]] = {}
        self.splits: list[dict[str, Any]] = []
        self._names: list[str] = []

    @override
    def on_federation_start(self, server: ServerView) -> None:
        self._names = trainable_names(server.module)

    @override
    def on_round_start(self, server: ServerView, round_idx: int, selected: list[str]) -> None:
        self._updates = {}

    @override
    def on_reply(self, server: ServerView, task: Task, reply: Reply, weight: float) -> None:
        delta = flatten(reply.state, self._names) - flatten(task.state, self._names)
        self._updates.setdefault(reply.group, {})[reply.client_id] = (delta, weight)

    @override
    def on_round_end(self, server: ServerView, round_idx: int, metrics: dict[str, Any]) -> None:
        fixed = self.split_round is not None
        if fixed and round_idx + 1 != self.split_round:
            return
        for group in list(server.groups):
            if len(server.groups) >= self.max_clusters:
                break
            recorded = self._updates.get(group.name, {})
            if len(recorded) < 2:
                continue
            ids = list(recorded)
            updates = torch.stack([recorded[c][0] for c in ids])
            weights = torch.tensor([recorded[c][1] for c in ids])
            if not fixed and not split_criterion(updates, weights / weights.sum(), self.eps1, self.eps2):
                continue
            halves = bipartition(updates)
            if halves is None:
                continue
            parts = [[ids[i] for i in half] for half in halves]
            unseen = [c for c in group.members if c not in recorded]
            max(parts, key=len).extend(unseen)
            children = server.split_group(group, parts)
            self.splits.append({"round": round_idx + 1, "group": group.name, "into": [c.members for c in children]})

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"splits": self.splits}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.splits = list(state_dict["splits"])
