"""HarmoFL's weight perturbation: a sharpness-aware step inside Lightning's automatic optimisation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import single_optimizer
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.sharpness import perturb, restore

if TYPE_CHECKING:
    from fl_lightning.callback import RuntimeView

METHOD = "WeightPerturbation"


class WeightPerturbation(FederatedCallback):
    """Trains flat client optima (HarmoFL, part 2): every optimiser step uses the gradient at w + δ.

    Per batch: g = ∇ℓ(w) (Lightning's own forward/backward); δ = α·g/(‖g‖₂ + 1e-12) with one global
    norm over all parameters; g' = ∇ℓ(w + δ) on the same batch; w restored exactly; the base
    optimiser (any: SGD, Adam, …) then steps with g'. The second pass runs in ``on_after_backward``,
    i.e. before every ``on_before_optimizer_step`` hook, so other methods' gradient changes (FedProx,
    SCAFFOLD) and Lightning's gradient clipping apply to g' whatever the callback order. It runs under the
    Trainer's precision context (autocast) and, with a gradient scaler (``16-mixed``), backpropagates the
    scaled loss, so the scaler's unscale and inf check cover g'. The second pass sees the same batch in
    train mode, except the module's ``input_norm`` (HarmoFL's amplitude layer), which runs in eval mode
    so that both passes see the same normalised input Ψ(x); every buffer (BatchNorm running statistics, the
    amplitude) is restored after it, so running statistics advance once per step. Lightning's backward
    hooks see one backward per step.

    Preconditions: automatic optimisation, one optimiser, ``trainer.accumulate_grad_batches=1``, and a
    module with ``training_loss(batch)`` (every ClientModule).

    Args:
        alpha: Perturbation radius α ≥ 0 (the paper sweeps 1 … 5e-4; α = 0 is the plain step at twice the cost).
            The radius is absolute, so what suits depends on the model: on the digits' BN CNN the default 0.05 makes
            the loss at w + δ 1.65× the loss at w at initialisation and held a binary 15 %/85 % task at the
            majority class; ``configs/harmofl_digits.yaml`` uses 0.01 (README, "Degenerate training").

    """

    def __init__(self, alpha: float = 0.05) -> None:
        super().__init__()
        if alpha < 0:
            raise ValueError(f"WeightPerturbation alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self._batch: Any = None

    @staticmethod
    def check(trainer: L.Trainer, pl_module: L.LightningModule, num_optimizers: int | None = None) -> None:
        """Raise :class:`PreconditionError` where the two-pass step cannot work."""
        if not pl_module.automatic_optimization:
            raise PreconditionError(
                f"{METHOD} needs Lightning's automatic optimisation (module.automatic_optimization)"
            )
        if num_optimizers is not None and num_optimizers != 1:
            raise PreconditionError(f"{METHOD} needs exactly one optimiser, the module configures {num_optimizers}")
        if trainer.accumulate_grad_batches != 1:
            raise PreconditionError(
                f"{METHOD} perturbs with each batch's own gradient; set trainer.accumulate_grad_batches=1 "
                f"(got {trainer.accumulate_grad_batches})"
            )
        if not callable(getattr(pl_module, "training_loss", None)):
            raise PreconditionError(f"{METHOD} needs a module with training_loss(batch) (a ClientModule)")

    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        # Loud before the first round: the same checks as at each fit start, without waiting for a Trainer fit.
        single_optimizer(runtime.module, METHOD)
        self.check(runtime.trainer, runtime.module)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer, pl_module, num_optimizers=len(trainer.optimizers))

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch = batch  # already on the device; the second pass reuses it

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._batch is None:
            return
        params = [p for p in pl_module.parameters() if p.requires_grad]
        buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
        saved = perturb(params, self.alpha)
        for p in params:
            p.grad = None
        # The input normalisation (HarmoFL's amplitude layer) in eval mode: both passes must see the same Ψ(x)
        # (paper, Eq. 7). In training mode it would update its running amplitude with this batch a second time
        # and normalise with that, i.e. take g' on another input than g.
        norm = getattr(pl_module, "input_norm", None)
        norm_was_training = norm is not None and norm.training
        if norm is not None:
            norm.eval()
        try:
            with torch.enable_grad(), trainer.precision_plugin.train_step_context():
                loss = pl_module.training_loss(self._batch)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        finally:
            if norm is not None:
                norm.train(norm_was_training)
        restore(saved)
        restore(buffers)
        self._batch = None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._batch = None
