"""Faults a test puts into a real deployment through the run's config (its sites import this with PYTHONPATH)."""

from __future__ import annotations

import torch

from callbacks import FederatedCallback


class CorruptReply(FederatedCallback):
    """The client half of ``client_id`` sends NaN weights in round ``round`` (0-based), after every check its own
    runtime makes: a well-formed message that would poison the mean (what a broken GPU or a bug can send).

    Args:
        client_id: The client whose reply is spoilt.
        round: The round (0-based) of the spoilt reply.
    """

    def __init__(self, client_id: str = "site2", round: int = 1) -> None:  # noqa: A002 - the config's word
        super().__init__()
        self.client_id, self.round = client_id, round

    def on_upload(self, ctx, reply) -> None:  # noqa: ANN001 - the hook's types
        if ctx.client_id == self.client_id and ctx.round == self.round:
            key = next(k for k, v in reply.state.items() if v.is_floating_point())
            reply.state[key] = torch.full_like(reply.state[key], float("nan"))
