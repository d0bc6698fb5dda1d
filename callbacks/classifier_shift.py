"""FedShift: shift the classifier's logits in the training loss by the log ratio of client to global prior."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from fl_lightning.errors import PreconditionError
from fl_lightning.ops import secure_sum
from fl_lightning.ops.label_shift import global_prior, logit_shift, smoothed_prior

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, ServerView

SHIFT_KEY = "logit_adjustment"


def masked_prior_upload(counts: torch.Tensor, client_ids: list[str], client: str, seed: int) -> torch.Tensor:
    """Client side of the secure sum: this client's masked [n_i π_i, n_i] (fixed-point int64).

    Args:
        counts: The client's training label counts (stay on the client).
        client_ids: Every participating client, in the order the server gave.
        client: This client.
        seed: Session seed from which the pair seeds are derived.

    """
    n_i = counts.sum().double()
    vector = torch.cat([n_i * smoothed_prior(counts), n_i.reshape(1)])
    return secure_sum.mask(vector, secure_sum.client_mask(client_ids, client, len(vector), seed))


def server_global_prior(masked: list[torch.Tensor]) -> torch.Tensor:
    """Server side: the global prior π from masked uploads only (it never sees one client's counts)."""
    total = secure_sum.server_sum(masked)
    return global_prior(total[:-1], float(total[-1]))


class ClassifierShift(FederatedCallback):
    """FedShift (Shen, Wang, Lv, 2023): CE(f(x) + s_i, y) locally, with s_i = τ(log π_i − log π).

    π_i is the client's Laplace-smoothed label prior, π the global prior Σ_i (n_i/n) π_i, computed once
    before the first round by pairwise-masked secure aggregation, as two query tasks: ``masked_counts``
    (each client replies with its masked [n_i π_i, n_i]; the masks cancel in the sum, so the server learns
    only the total) and ``set_prior`` (the server sends π; each client stores its own shift). The shift lives
    in the client module's ``logit_adjustment`` buffer, which only the training loss reads: evaluation and
    inference use the plain logits. The buffer is private (never averaged). The server does FedAvg.

    Args:
        tau: Shift strength τ (1 follows the paper's Bayes argument).

    """

    def __init__(self, tau: float = 1.0) -> None:
        super().__init__()
        self.tau = tau
        self.prior: torch.Tensor | None = None

    @override
    def private_keys(self, module: L.LightningModule) -> set[str]:
        if SHIFT_KEY not in module.state_dict():
            raise PreconditionError(f"ClassifierShift needs a client module with a `{SHIFT_KEY}` buffer")
        return {SHIFT_KEY}

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: ServerView) -> None:
        if self.prior is not None:  # restored from a checkpoint (the clients' shifts are in their runtime's)
            return
        ids = list(server.data.client_ids)
        masked = server.query(self, "masked_counts", ids, {"client_ids": ids, "seed": server.seed})
        self.prior = server_global_prior([masked[c] for c in ids])
        server.query(self, "set_prior", ids, self.prior)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"prior": self.prior}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.prior = state_dict["prior"]

    # ------------------------------------------------------------------ client half
    @override
    def answer_query(self, ctx: ClientContext, name: str, payload: Any) -> Any:
        counts = ctx.data.label_counts(ctx.client_id)
        if name == "masked_counts":
            return masked_prior_upload(counts, list(payload["client_ids"]), ctx.client_id, int(payload["seed"]))
        if name == "set_prior":
            ctx.state["shift"] = logit_shift(smoothed_prior(counts), payload, self.tau).float()
            return None
        return super().answer_query(ctx, name, payload)

    @override
    def on_client_start(self, ctx: ClientContext, module: L.LightningModule) -> None:
        getattr(module, SHIFT_KEY).copy_(ctx.state["shift"])
