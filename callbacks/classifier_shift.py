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
    from fl_lightning.federation import Federation

SHIFT_KEY = "logit_adjustment"


def masked_prior_uploads(counts: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Client side of the secure sum: each client's masked [n_i π_i, n_i] (fixed-point int64).

    Args:
        counts: Each client's training label counts (stays on the client).
        seed: Session seed from which pair seeds are derived.

    """
    ids = list(counts)
    size = len(next(iter(counts.values()))) + 1
    masks = secure_sum.pairwise_masks(ids, size, seed)
    uploads = {}
    for cid in ids:
        n_i = counts[cid].sum().double()
        vector = torch.cat([n_i * smoothed_prior(counts[cid]), n_i.reshape(1)])
        uploads[cid] = secure_sum.mask(vector, masks[cid])
    return uploads


def server_global_prior(masked: list[torch.Tensor]) -> torch.Tensor:
    """Server side: the global prior π from masked uploads only (it never sees one client's counts)."""
    total = secure_sum.server_sum(masked)
    return global_prior(total[:-1], float(total[-1]))


class ClassifierShift(FederatedCallback):
    """FedShift (Shen, Wang, Lv, 2023): CE(f(x) + s_i, y) locally, with s_i = τ(log π_i − log π).

    π_i is the client's Laplace-smoothed label prior, π the global prior Σ_i (n_i/n) π_i, computed
    once before the first round by pairwise-masked secure aggregation. The shift lives in the client
    module's ``logit_adjustment`` buffer, which only the training loss reads: evaluation and
    inference use the plain logits. The buffer is private (never averaged). The server does FedAvg.

    Args:
        tau: Shift strength τ (1 follows the paper's Bayes argument).

    """

    def __init__(self, tau: float = 1.0) -> None:
        super().__init__()
        self.tau = tau
        self.shifts: dict[str, torch.Tensor] = {}
        self.prior: torch.Tensor | None = None

    @override
    def private_keys(self, module: L.LightningModule) -> set[str]:
        if SHIFT_KEY not in module.state_dict():
            raise PreconditionError(f"ClassifierShift needs a client module with a `{SHIFT_KEY}` buffer")
        return {SHIFT_KEY}

    @override
    def on_federation_start(self, federation: Federation) -> None:
        if self.shifts:  # restored from a checkpoint
            return
        counts = {cid: federation.data.label_counts(cid) for cid in federation.data.client_ids}
        uploads = masked_prior_uploads(counts, federation.seed)
        self.prior = server_global_prior(list(uploads.values()))
        # Back on each client: its own shift from its own prior and the broadcast global prior.
        self.shifts = {cid: logit_shift(smoothed_prior(c), self.prior, self.tau).float() for cid, c in counts.items()}

    @override
    def on_client_start(self, federation: Federation, client_id: str, module: L.LightningModule) -> None:
        getattr(module, SHIFT_KEY).copy_(self.shifts[client_id])

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"shifts": self.shifts, "prior": self.prior}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.shifts, self.prior = dict(state_dict["shifts"]), state_dict["prior"]
