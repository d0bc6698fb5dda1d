"""APFL: a personal model mixed with the global one by a learned weight α per client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from callbacks.personal.phases import TwoPhaseFit
from fl_lightning.ops import clone_state
from fl_lightning.ops.apfl import alpha_step, mix_state

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext
    from fl_lightning.ops.state import StateDict


class APFL(TwoPhaseFit):
    """APFL (Deng, Kamani, Mahdavi, 2020): each client keeps v_i and α_i; its model is v̄_i = α_i v_i + (1 − α_i) w.

    **Client half.** One fit of two phases (:mod:`callbacks.personal.phases`): the received w^t is trained for
    ``federation.local_epochs`` on the client's usual batches and uploaded, exactly as FedAvg; then for
    ``personal_epochs`` on its own batches the client trains the mixture with the received global model,
    v̄_i = α_i v_i + (1 − α_i) w^t: each step computes g = ∇F_i(v̄_i) at the mixture (the module's parameters hold
    v̄_i for the forward pass), updates α_i ← clip(α_i − η_α ⟨v_i − w^t, g⟩, 0, 1) (``adaptive``), and the
    optimiser steps v_i with the gradient ∂F_i(v̄_i)/∂v_i = α_i g; the mixture is then rebuilt. v_i, α_i and the
    mixture stay on the site; the mixture is the ``personal`` model the evaluation scores. Running statistics (a
    norm layer's) are the personal model's: they are updated by its forward passes and are not mixed.

    Departure from the paper: its step updates w and v_i together, mixing with the local iterate of w; here the
    two are trained one after the other in the client's one ``trainer.fit``, and the personal epochs mix with the
    received w^t, the global model the evaluated mixture uses.

    **Server half.** FedAvg (nothing to add).

    Invariants (``tests/callbacks/test_personal.py``): α fixed at 1 is local training of v_i; α fixed at 0 keeps
    the received global model as the personal one; one round matches a plain-torch reference that differentiates
    through the mixture with autograd.

    Args:
        alpha: α_i's initial value in [0, 1] (the paper's 0.5 … 0.75).
        alpha_lr: η_α ≥ 0, the step size of α.
        adaptive: Learn α (False: keep it at ``alpha``).
        personal_epochs: The personal model's epochs per fit (None: ``federation.local_epochs``).
    """

    def __init__(
        self, alpha: float = 0.5, alpha_lr: float = 0.01, adaptive: bool = True, personal_epochs: int | None = None
    ) -> None:
        super().__init__(personal_epochs)
        if not 0 <= alpha <= 1:
            raise ValueError(f"APFL alpha must be in [0, 1], got {alpha}")
        if alpha_lr < 0:
            raise ValueError(f"APFL alpha_lr must be >= 0, got {alpha_lr}")
        self.alpha, self.alpha_lr, self.adaptive = alpha, alpha_lr, adaptive

    @override
    def enter_personal(self, ctx: ClientContext, module: L.LightningModule, run: dict[str, Any]) -> None:
        received = run["received"]
        module.load_state_dict(ctx.state.get("personal_model") or received)
        params = run["params"]
        run["alpha"] = float(ctx.state.get("alpha", self.alpha))
        run["global"] = [received[k].to(p.device) for k, p in zip(self._names, params)]
        run["v"] = [p.detach().clone() for p in params]
        run["stepped"] = False
        self._load_mixture(run)

    @staticmethod
    @torch.no_grad()
    def _load_mixture(run: dict[str, Any]) -> None:
        for p, v, w in zip(run["params"], run["v"], run["global"]):
            p.copy_(torch.lerp(w, v, run["alpha"]))

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.in_personal_phase():
            return
        run = self._run
        params, alpha = run["params"], run["alpha"]
        with torch.no_grad():
            if self.adaptive:
                run["alpha"] = alpha_step(alpha, run["v"], run["global"], [p.grad for p in params], self.alpha_lr)
            for p, v in zip(params, run["v"]):
                if p.grad is not None:
                    p.grad.mul_(alpha)  # ∂F(v̄)/∂v = α ∇F(v̄)
                p.copy_(v)  # the optimiser steps the personal model
        run["stepped"] = True

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        run = self._run
        if self.in_personal_phase() and run["stepped"]:
            with torch.no_grad():
                for p, v in zip(run["params"], run["v"]):
                    v.copy_(p)
            self._load_mixture(run)
            run["stepped"] = False

    @override
    def personal_result(
        self, ctx: ClientContext, module: L.LightningModule, run: dict[str, Any]
    ) -> tuple[StateDict, dict[str, Any]]:
        # the parameters hold the mixture (rebuilt after the last step); v_i is run["v"], the rest the module's
        own = {**clone_state(module.state_dict()), **{k: v.detach().clone() for k, v in zip(self._names, run["v"])}}
        mixture = mix_state(own, run["received"], run["alpha"], set(self._names))
        return mixture, {"personal_model": own, "alpha": run["alpha"]}
