"""Ditto: a personal model per client, pulled towards the global model by a proximal term."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from callbacks.personal.phases import TwoPhaseFit
from fl_lightning.ops import add_proximal_gradient, clone_state

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext
    from fl_lightning.ops.state import StateDict


class Ditto(TwoPhaseFit):
    """Ditto (Li, Hu, Beirami, Smith, ICML 2021): FedAvg for the global model w, and a personal model v_i per client.

    **Client half.** One fit of two phases (:mod:`callbacks.personal.phases`): the received w^t is trained for
    ``federation.local_epochs`` on the client's usual batches and uploaded, exactly as FedAvg; then the client's
    personal model v_i (the received w^t at its first fit) is trained for ``personal_epochs`` on its own batches,
    on F_i(v_i) + λ/2 ‖v_i − w^t‖², the term added to the gradient before each optimiser step as λ(v_i − w^t).
    v_i never leaves the site; it is what the ``personal`` evaluation and the cross-site evaluation score.

    **Server half.** FedAvg (nothing to add).

    Invariants (``tests/callbacks/test_personal.py``): the global model is FedAvg's bit for bit whatever λ; λ = 0
    is local training of v_i; as λ grows v_i stays closer to w^t.

    Args:
        lam: λ ≥ 0, the pull of the personal model towards the global one (the paper's 0.01 … 2).
        personal_epochs: The personal model's epochs per fit (None: ``federation.local_epochs``).
    """

    def __init__(self, lam: float = 0.1, personal_epochs: int | None = None) -> None:
        super().__init__(personal_epochs)
        if lam < 0:
            raise ValueError(f"Ditto lam must be >= 0, got {lam}")
        self.lam = lam

    @override
    def enter_personal(self, ctx: ClientContext, module: L.LightningModule, run: dict[str, Any]) -> None:
        received = run["received"]
        module.load_state_dict(ctx.personal if ctx.personal is not None else received)
        run["anchors"] = [received[k].to(p.device) for k, p in zip(self._names, run["params"])]

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.in_personal_phase():
            add_proximal_gradient(self._run["params"], self._run["anchors"], self.lam)

    @override
    def personal_result(
        self, ctx: ClientContext, module: L.LightningModule, run: dict[str, Any]
    ) -> tuple[StateDict, dict[str, Any]]:
        return clone_state(module.state_dict()), {}
