"""FedALA: each client starts its round from an element-wise, learned mix of its own model and the received one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.fabric.utilities import move_data_to_device
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.head_body.heads import head_keys
from callbacks.preconditions import trainable_names
from datamodules.sampler import SeededEpochSampler, stable_seed
from fl_lightning.errors import PreconditionError
from fl_lightning.ops import clone_state
from fl_lightning.ops.fedala import ala_mix, ala_weight_step, converged

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, RuntimeView
    from fl_lightning.wire.protocol import Reply

METHOD = "FedALA"


class FedALA(FederatedCallback):
    """FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the received model into the client's own.

    **Client half.** At its first fit a client trains the received model Θ, as FedAvg. From its second fit on, before
    the first training step (``on_train_start``), it builds its starting point θ̂ from its own model of its last fit
    θ_i and the received Θ: the lower layers are Θ's; the aggregated layers (``head``: module names, else the last
    ``nn.Linear`` or convolution, as FedALA's ``layer_idx = 2``) are θ̂ = θ_i + (Θ − θ_i) ⊙ W_i, with element-wise
    weights W_i ∈ [0, 1] (all ones at first) kept on the site and learned on a random ``sample_fraction`` of its
    training set: per batch, W_i ← clip(W_i − η ∇_θ̂L ⊙ (Θ − θ_i), 0, 1) and θ̂ is rebuilt. The first adaptation
    repeats passes until the standard deviation of the last ``window`` pass losses is below ``threshold`` (at
    most ``max_first_passes``); later ones make one pass. The adaptation's forward passes do not change the
    module's running statistics (they are the received model's, as FedAvg's). Then the client trains θ̂ as usual,
    keeps the trained model as its own θ_i (:attr:`ClientContext.personal`, what the ``personal`` and cross-site
    evaluations score) and uploads it.

    **Server half.** FedAvg (nothing to add).

    Departures from the reference code (PFLlib's ``ALA.py``): the sample is a seeded random subset, not a random
    contiguous slice; the first adaptation has a cap on its passes; the personal model scored is the client's
    trained model, not the next round's adapted start (which would need an adaptation pass for every client at
    every evaluation).

    Invariants (``tests/callbacks/test_fedala.py``): η = 0 keeps W = 1, so the global model is FedAvg's bit for bit;
    the weights stay in [0, 1]; one adaptation and the fit after it match a plain-torch reference that
    differentiates the loss with respect to W by autograd.

    Args:
        eta: η ≥ 0, the step size of the weights (FedALA's 1.0).
        sample_fraction: The fraction of the client's training samples the weights are learned on, in (0, 1].
        head: Module names of the aggregated layers (None: found).
        window: Passes whose losses the first adaptation's stopping rule reads.
        threshold: Their standard deviation below which the first adaptation stops.
        max_first_passes: The most passes of the first adaptation.
    """

    def __init__(
        self,
        eta: float = 1.0,
        sample_fraction: float = 0.8,
        head: list[str] | None = None,
        window: int = 10,
        threshold: float = 0.1,
        max_first_passes: int = 50,
    ) -> None:
        super().__init__()
        if eta < 0:
            raise ValueError(f"{METHOD} eta must be >= 0, got {eta}")
        if not 0 < sample_fraction <= 1:
            raise ValueError(f"{METHOD} sample_fraction must be in (0, 1], got {sample_fraction}")
        if window < 1 or max_first_passes < 1:
            raise ValueError(f"{METHOD} window and max_first_passes must be >= 1, got {window}, {max_first_passes}")
        self.eta, self.sample_fraction, self.window = eta, sample_fraction, window
        self.threshold, self.max_first_passes = threshold, max_first_passes
        self.head = None if head is None else list(head)
        self._adapted: list[str] = []

    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        keys = head_keys(runtime.module, self.head, METHOD)
        self._adapted = [k for k in trainable_names(runtime.module) if k in keys]
        if not self._adapted:
            raise PreconditionError(f"{METHOD}: the aggregated layers {sorted(keys)} have no trainable parameters")

    def sample_loader(self, ctx: ClientContext) -> Any:
        """The batches the weights are learned on this round: a seeded random subset of the client's training set."""
        n = ctx.data.num_train_samples(ctx.client_id)
        size = max(1, int(n * self.sample_fraction))
        seed = stable_seed(ctx.seed, METHOD, "sample", ctx.client_id, ctx.round)
        indices = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size]
        sampler = SeededEpochSampler(size, seed)
        return ctx.data.client_subset_train_loader(ctx.client_id, indices, sampler)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ctx = self.fit_context
        if ctx.personal is None:
            return  # the first fit: no own model yet, the client starts from Θ
        named = dict(pl_module.named_parameters())
        params = [named[k] for k in self._adapted]
        received = [p.detach().clone() for p in params]
        own = [ctx.personal[k].to(p) for k, p in zip(self._adapted, params)]
        kept = ctx.state.get("weights")
        if kept is not None and set(kept) != set(self._adapted):
            raise PreconditionError(
                f"{METHOD}: client {ctx.client_id}'s kept weights are for {sorted(kept)}, the aggregated layers are "
                f"{self._adapted}; resume with the head the run started with"
            )
        weights = [kept[k].to(p) if kept is not None else torch.ones_like(p) for k, p in zip(self._adapted, params)]
        statistics = clone_state(dict(pl_module.named_buffers()))
        first = not ctx.state.get("adapted", False)
        losses = self._adapt(pl_module, params, own, received, weights, self.sample_loader(ctx), first)
        with torch.no_grad():
            for name, buffer in pl_module.named_buffers():
                buffer.copy_(statistics[name])  # the adaptation's forward passes leave no trace in the statistics
        ctx.state.update(
            weights={k: w.detach().cpu().clone() for k, w in zip(self._adapted, weights)},
            adapted=True,
            passes=len(losses),
        )

    def _adapt(
        self,
        module: L.LightningModule,
        params: list[torch.Tensor],
        own: list[torch.Tensor],
        received: list[torch.Tensor],
        weights: list[torch.Tensor],
        loader: Any,
        first: bool,
    ) -> list[float]:
        """Learn ``weights`` in place on ``loader`` and leave θ̂ in ``params``; returns each pass's last batch loss."""
        was_training = module.training
        module.train()
        losses: list[float] = []
        self._load(params, ala_mix(own, received, weights))
        while True:
            loss = None
            for batch in loader:
                loss = module.training_loss(move_data_to_device(batch, module.device))
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                weights[:] = ala_weight_step(weights, grads, own, received, self.eta)
                self._load(params, ala_mix(own, received, weights))
            losses.append(float("nan") if loss is None else loss.item())
            if not first or len(losses) >= self.max_first_passes or converged(losses, self.window, self.threshold):
                break
        module.train(was_training)
        return losses

    @staticmethod
    @torch.no_grad()
    def _load(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        for p, v in zip(params, values):
            p.copy_(v)

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        ctx.personal = clone_state(reply.state)  # the trained model: the client's own θ_i (before upload transforms)
