"""DP-SGD: sample-level differential privacy inside each client's local fit, with Opacus."""

from __future__ import annotations

import math
import sys
import warnings
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import single_optimizer
from datamodules.sampler import stable_seed
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.dp_meaning import warn_if_large
from fl_lightning.ops.dp_sgd import (
    ACCOUNTANTS,
    add_steps,
    batch_norm_layers,
    calibrate_noise,
    epsilon,
    poisson_loader,
)

if TYPE_CHECKING:
    from opacus.grad_sample.grad_sample_module import GradSampleHooks
    from torch.utils.data import DataLoader

    from fl_lightning.callback import ClientContext, RuntimeView, ServerView
    from fl_lightning.wire.protocol import Reply, Task

DOCS_PAGE = "docs/methods/dp-sgd.md, 'Choosing σ, C and the learning rate'"

# Opacus hooks the first layer too, whose input needs no gradient; torch then warns on every fit. Nothing is wrong:
# its per-example gradients come from its output's gradient, which the hook receives.
warnings.filterwarnings("ignore", message=r"Full backward hook is firing when gradients are computed with respect")


class PrivacyBudgetExhausted(RuntimeError):
    """A client's next fit would take its ε past ``max_epsilon``: it does not train (the round leaves it out)."""


def noise_seed(seed: int, client_id: str, round_idx: int) -> int:
    """Seed of the generator of the Gaussian noise of one client fit (so a resumed run draws the same noise)."""
    return stable_seed(seed, "dpsgd-noise", client_id, round_idx)


def poisson_seed(seed: int, client_id: str, round_idx: int) -> int:
    """Seed of the generator of the Poisson batches of one client fit."""
    return stable_seed(seed, "dpsgd-poisson", client_id, round_idx)


class DPSGD(FederatedCallback):
    """DP-SGD (Abadi et al., 2016) on every client: per-example clipping and Gaussian noise in each local step.

    **Client half.** For the local fit on the shared Trainer, Opacus' per-sample gradient hooks
    (:class:`opacus.grad_sample.GradSampleHooks`, attached to the module without wrapping it) are added in
    ``on_train_start`` and the optimiser that ``configure_optimizers`` built is wrapped in an
    :class:`opacus.optimizers.DPOptimizer`: each step clips every example's gradient to norm ≤ C
    (``max_grad_norm``), sums, adds N(0, σ²C²) drawn from a generator seeded by (seed, client, round), divides by
    the expected batch size B and steps. ``on_train_end`` (or ``on_exception``) removes the hooks and puts the
    plain optimiser back, so nothing leaks into the next client's fit or into a run without the callback.

    With ``poisson=True`` the client's loader is replaced (``wrap_train_loader``) by Poisson batches over its n_i
    examples at rate q_i = B/n_i (Opacus' ``UniformWithReplacementSampler``), as many per pass as the plain loader
    has (the same local budget, epochs or steps); with ``poisson=False`` the shuffled fixed batches are kept and
    accounted *as if* Poisson-sampled at q_i: the common practice, not exactly what the analysis assumes.

    The client's accountant history (``(σ, q, steps)`` entries, Opacus' own ``step`` hook counting every noised
    step) and σ live in its private state (``ctx.state``), so checkpoints resume them exactly. Steps that ran
    count even when the fit then fails. Each reply carries the client's ε at its δ. A Poisson batch may come out
    empty (probability (1 − q_i)^{n_i} per step): Opacus then takes a noise-only step, but the classification loss
    of no example is nan, so the client is dropped from that round with the usual warning.

    **Server half.** Records per round ``privacy/epsilon_worst`` and ``privacy/epsilon_mean`` (over the clients
    that have trained so far) and ``privacy/exhausted_clients``; ``summary.json`` gets a ``privacy`` entry (ε per
    client, δ, mechanism, parameters).

    **Budgets.** ``target_epsilon`` calibrates σ_i per client before its first fit (Opacus' ``get_noise_multiplier``)
    for planned steps = ``federation.rounds`` × its local steps per round, as if it trained every round. With
    ``max_epsilon``, a client whose next fit would take it past the budget does not train: its fit raises
    :class:`PrivacyBudgetExhausted` before any step, the Federation warns naming it and leaves it out of the round
    (``round/failed_clients``), and the server lists it in ``privacy/exhausted_clients``.

    Preconditions (checked before training): one optimiser, automatic optimisation, no BatchNorm (set
    ``model.norm=group``, or ``fix_model=True`` to let Opacus replace it by GroupNorm), layers Opacus supports,
    ``accumulate_grad_batches=1``, no Trainer gradient clipping, and no other callback that edits gradients in
    ``on_before_optimizer_step`` (the DP optimiser overwrites them with the noised sum) or that changes the training
    loader (the accounting assumes q = B/n_i over the client's own examples). δ must be below 1/n_i for every client.

    Args:
        noise_multiplier: σ ≥ 0 (0: clipping only, ε = ∞). Give this or ``target_epsilon``.
        target_epsilon: ε > 0 to reach after ``federation.rounds`` rounds; calibrates σ per client.
        max_grad_norm: Per-example clipping norm C > 0 (``inf``, no clipping, only with ``noise_multiplier=0``).
        delta: δ of the guarantee; default 0.1/n_i per client (an order of magnitude below 1/n_i).
        poisson: Poisson-sampled batches (the analysis' assumption) instead of the shuffled fixed ones.
        accountant: Opacus accountant: ``rdp``, ``prv`` or ``gdp``.
        max_epsilon: Budget per client; a client does not train past it. ``None``: no budget.
        fix_model: Replace BatchNorm layers by GroupNorm (Opacus' ``ModuleValidator`` fixers) instead of refusing.

    """

    def __init__(
        self,
        *,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        max_grad_norm: float = 1.0,
        delta: float | None = None,
        poisson: bool = True,
        accountant: str = "rdp",
        max_epsilon: float | None = None,
        fix_model: bool = False,
    ) -> None:
        super().__init__()
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("DPSGD needs exactly one of noise_multiplier and target_epsilon")
        if noise_multiplier is not None and not noise_multiplier >= 0:
            raise ValueError(f"DPSGD noise_multiplier must be >= 0, got {noise_multiplier}")
        if target_epsilon is not None and not target_epsilon > 0:
            raise ValueError(f"DPSGD target_epsilon must be > 0, got {target_epsilon}")
        if not max_grad_norm > 0:
            raise ValueError(f"DPSGD max_grad_norm must be > 0, got {max_grad_norm}")
        if math.isinf(max_grad_norm) and noise_multiplier != 0:
            raise ValueError(
                "DPSGD max_grad_norm=inf (no clipping) bounds no sensitivity: use it only with noise_multiplier=0"
            )
        if delta is not None and not 0 < delta < 1:
            raise ValueError(f"DPSGD delta must be in (0, 1), got {delta}")
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"DPSGD accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
        if max_epsilon is not None and not max_epsilon > 0:
            raise ValueError(f"DPSGD max_epsilon must be > 0, got {max_epsilon}")
        self.noise_multiplier, self.target_epsilon = noise_multiplier, target_epsilon
        self.max_grad_norm, self.delta, self.poisson = float(max_grad_norm), delta, poisson
        self.accountant, self.max_epsilon, self.fix_model = accountant, max_epsilon, fix_model
        # server half: the last report of every client that trained
        self.reports: dict[str, dict[str, Any]] = {}
        # client half: the running fit
        self._fit: dict[str, Any] | None = None
        self._attached: tuple[GradSampleHooks | None, torch.optim.Optimizer, Any, list[torch.nn.Module]] | None = None
        self._plain_steps = 0  # optimiser steps of a fit without noise and clipping (no Opacus attached)
        self._warned_large = False  # the client half warned of a planned ε above 10 (once per process)
        self.planned_rounds: int | None = None  # federation.rounds the clients' σ was calibrated for (target_epsilon)

    # ------------------------------------------------------------------ both sides
    @override
    def prepare_module(self, module: L.LightningModule, data: Any) -> None:
        if not self.fix_model:
            return
        from opacus.validators import ModuleValidator  # imported where used: see fl_lightning.ops.dp_sgd

        # In place (ModuleValidator.fix would return a copy): the one module is shared by every client.
        for name in batch_norm_layers(module):
            parent_name, _, child = name.rpartition(".")
            parent = module.get_submodule(parent_name)
            layer = parent.get_submodule(child)
            setattr(parent, child, ModuleValidator.FIXERS[type(layer)](layer))

    # ------------------------------------------------------------------ server half
    @override
    def on_reply(self, server: ServerView, task: Task, reply: Reply, weight: float) -> None:
        report = self.get_payload(reply)
        if report is not None:
            self.reports[reply.client_id] = dict(report)

    @override
    def on_round_end(self, server: ServerView, round_idx: int, metrics: dict[str, Any]) -> None:
        epsilons = [r["epsilon"] for r in self.reports.values()]
        if epsilons:
            metrics["privacy/epsilon_worst"] = max(epsilons)
            metrics["privacy/epsilon_mean"] = sum(epsilons) / len(epsilons)
        metrics["privacy/exhausted_clients"] = sum(bool(r["exhausted"]) for r in self.reports.values())

    @override
    def summary_entries(self, server: ServerView) -> dict[str, Any]:
        epsilons = {c: r["epsilon"] for c, r in sorted(self.reports.items())}
        return {
            "privacy": {
                "mechanism": "DP-SGD (sample-level, Opacus)",
                "accountant": self.accountant,
                "poisson": self.poisson,
                "max_grad_norm": self.max_grad_norm,
                "target_epsilon": self.target_epsilon,
                "max_epsilon": self.max_epsilon,
                "epsilon_worst": max(epsilons.values()) if epsilons else None,
                "epsilon": epsilons,
                "delta": {c: r["delta"] for c, r in sorted(self.reports.items())},
                "noise_multiplier": {c: r["noise_multiplier"] for c, r in sorted(self.reports.items())},
                "sample_rate": {c: r["sample_rate"] for c, r in sorted(self.reports.items())},
                "steps": {c: r["steps"] for c, r in sorted(self.reports.items())},
                "exhausted": sorted(c for c, r in self.reports.items() if r["exhausted"]),
            }
        }

    @override
    def on_federation_start(self, server: ServerView) -> None:
        rounds = server.config.rounds
        if self.target_epsilon is None:
            return
        if self.planned_rounds is None:  # the first start (or a checkpoint from before planned_rounds existed)
            self.planned_rounds = rounds
        elif rounds > self.planned_rounds:
            raise ValueError(
                f"DPSGD target_epsilon={self.target_epsilon}: each client's σ was calibrated for "
                f"federation.rounds={self.planned_rounds}; this resume asks for federation.rounds={rounds}, which "
                "would take the clients past the target. A run with a target ε cannot be extended on resume: resume "
                f"with federation.rounds={self.planned_rounds} or fewer, or start a new run (noise_multiplier with "
                "max_epsilon can run until its budget)"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"reports": self.reports, "planned_rounds": self.planned_rounds}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reports = {c: dict(r) for c, r in state_dict["reports"].items()}
        self.planned_rounds = state_dict.get("planned_rounds")

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        from opacus.validators import ModuleValidator

        module, trainer = runtime.module, runtime.trainer
        single_optimizer(module, "DPSGD")
        norms = batch_norm_layers(module)
        if norms:
            raise PreconditionError(
                f"DPSGD cannot train BatchNorm layers ({', '.join(norms)}): their batch statistics mix examples, so "
                "per-example gradients are undefined. Set model.norm=group (or instance / none), or "
                "DPSGD(fix_model=true) to replace them by GroupNorm"
            )
        unsupported = ModuleValidator.validate(module, strict=False)
        if unsupported:
            raise PreconditionError(f"DPSGD: Opacus cannot compute per-example gradients here: {unsupported}")
        if trainer.accumulate_grad_batches != 1:
            raise PreconditionError("DPSGD noises every step; set trainer.accumulate_grad_batches=1")
        if trainer.gradient_clip_val:
            raise PreconditionError(
                "DPSGD clips per example (max_grad_norm); remove trainer.gradient_clip_val, which would act on the "
                "gradient the DP optimiser then overwrites"
            )
        editors = [
            type(cb).__name__
            for cb in trainer.callbacks
            if cb is not self and type(cb).on_before_optimizer_step is not L.Callback.on_before_optimizer_step
        ]
        if editors:
            raise PreconditionError(
                f"DPSGD cannot be combined with {editors}: they edit gradients in on_before_optimizer_step, which the "
                "DP optimiser overwrites with the clipped and noised sum"
            )
        loaders = [
            type(cb).__name__
            for cb in runtime.callbacks
            if cb is not self and type(cb).wrap_train_loader is not FederatedCallback.wrap_train_loader
        ]
        if loaders:
            raise PreconditionError(
                f"DPSGD cannot be combined with {loaders}: they change the training loader, whose sample rate q = B/n "
                "the accounting assumes"
            )
        if self.delta is not None:
            for cid in runtime.client_ids:
                if cid in runtime.data.client_ids and self.delta >= 1 / runtime.data.num_train_samples(cid):
                    n = runtime.data.num_train_samples(cid)
                    raise PreconditionError(
                        f"DPSGD delta={self.delta} is not below 1/n for client {cid!r} (n={n}): such a δ allows "
                        f"releasing an example outright; set delta < {1 / n:.3g} (or leave it unset for 0.1/n)"
                    )

    @override
    def on_client_start(self, ctx: ClientContext, module: L.LightningModule) -> None:
        self._fit = None

    @override
    def wrap_train_loader(self, ctx: ClientContext, loader: DataLoader) -> DataLoader:
        n, batch_size = len(loader.dataset), loader.batch_size
        if batch_size is None:
            raise PreconditionError("DPSGD needs the client's loader to have a fixed batch_size (B of q = B/n)")
        sample_rate = min(1.0, batch_size / n)
        passes = 1 if ctx.task.steps else ctx.task.epochs
        steps = passes * len(loader)
        delta = self.delta if self.delta is not None else 0.1 / n
        state = ctx.state
        history = state.get("history", [])
        if "noise_multiplier" not in state:
            if self.noise_multiplier is not None:
                state["noise_multiplier"] = float(self.noise_multiplier)
            else:  # planned: every round at this fit's budget (client sampling only lowers the real ε)
                planned = ctx.config.rounds * steps
                try:
                    state["noise_multiplier"] = calibrate_noise(
                        self.target_epsilon, delta, sample_rate, planned, self.accountant
                    )
                except ValueError as err:  # Opacus: "The privacy budget is too low."
                    raise PreconditionError(
                        f"DPSGD target_epsilon={self.target_epsilon} cannot be reached by client {ctx.client_id!r}: "
                        f"no noise multiplier keeps {planned} steps at sample rate {sample_rate:.3g} (δ={delta:.3g}) "
                        f"within it ({err}). Raise target_epsilon, or lower federation.rounds or the local steps"
                    ) from None
        sigma = float(state["noise_multiplier"])
        if self.target_epsilon is not None:  # restored σ of a run extended past its plan (an older checkpoint)
            planned = epsilon([(sigma, sample_rate, ctx.config.rounds * steps)], delta, self.accountant)
            if planned > self.target_epsilon:
                raise PreconditionError(
                    f"DPSGD target_epsilon={self.target_epsilon}: client {ctx.client_id!r}: its σ={sigma:.4g} was "
                    f"calibrated for fewer rounds than federation.rounds={ctx.config.rounds} (ε would reach "
                    f"{planned:.4g}); resume with the rounds the run started with"
                )
        if not history and not self._warned_large:  # a client's first fit: what its plan ends at (once a process)
            self._warned_large = self._warn_if_large(ctx, sigma, sample_rate, steps, delta)
        self._fit = {"sigma": sigma, "q": sample_rate, "batch_size": batch_size, "delta": delta, "steps": steps}
        if self.max_epsilon is not None:
            after = epsilon(add_steps(history, sigma, sample_rate, steps), delta, self.accountant)
            if after > self.max_epsilon and not history:  # not even one fit fits: a setting, not a spent budget
                raise PreconditionError(
                    f"DPSGD max_epsilon={self.max_epsilon} is below ε={after:.4g} of one fit of client "
                    f"{ctx.client_id!r} (σ={sigma:.4g}, {steps} steps at sample rate {sample_rate:.3g}, "
                    f"δ={delta:.3g}): "
                    "no client could train. Raise max_epsilon or the noise (noise_multiplier / target_epsilon)"
                )
            if after > self.max_epsilon:
                self._fit["exhausted"] = (
                    f"client {ctx.client_id!r} is at ε={epsilon(history, delta, self.accountant):.4g} and this fit "
                    f"would take it to ε={after:.4g} > max_epsilon={self.max_epsilon} (δ={delta:.3g}): it does not "
                    "train any more"
                )
        if not self.poisson:
            return loader
        generator = torch.Generator().manual_seed(poisson_seed(ctx.seed, ctx.client_id, ctx.round))
        return poisson_loader(loader.dataset, sample_rate, len(loader), generator, loader.collate_fn)

    def _warn_if_large(self, ctx: ClientContext, sigma: float, sample_rate: float, steps: int, delta: float) -> bool:
        """Warn when the client's planned fits (every round at this fit's budget) end above ε = 10; whether it did."""
        rounds = ctx.config.rounds
        planned = epsilon([(sigma, sample_rate, rounds * steps)], delta, self.accountant)
        what = (
            f"DPSGD: client {ctx.client_id!r}: the planned {rounds} rounds × {steps} steps at σ={sigma:.4g}, "
            f"q={sample_rate:.3g}"
        )
        return warn_if_large(planned, delta, what, DOCS_PAGE, self.max_epsilon)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is not None and "exhausted" in self._fit:
            # Raised inside the fit, before any step: the runtime replies with an error and the round goes on.
            raise PrivacyBudgetExhausted(self._fit["exhausted"])

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit is None:
            return  # not a federated client fit
        from opacus.accountants import create_accountant
        from opacus.grad_sample.grad_sample_module import GradSampleHooks
        from opacus.optimizers import DPOptimizer

        fit, ctx = self._fit, self.fit_context
        (optimizer,) = trainer.strategy.optimizers
        if fit["sigma"] == 0 and math.isinf(self.max_grad_norm):
            # No noise and no clipping is plain SGD (ε = ∞): let autograd's batch gradient stand instead of Opacus'
            # sum of per-example gradients (the same sum in another order), so the run is FedAvg's bit for bit.
            self._attached = (None, optimizer, None, [])
            self._plain_steps = 0
            return
        # Opacus' full backward hooks forbid in-place ops on a hooked layer's output (ReLU(inplace=True) after a
        # conv): switch them off for the fit (same values, one more buffer) and back on in _detach.
        inplace = [m for m in pl_module.modules() if getattr(m, "inplace", False) is True]
        for m in inplace:
            m.inplace = False
        hooks = GradSampleHooks(pl_module, batch_first=True, loss_reduction="mean", strict=True)
        generator = torch.Generator(device=pl_module.device).manual_seed(noise_seed(ctx.seed, ctx.client_id, ctx.round))
        dp = DPOptimizer(
            optimizer,
            noise_multiplier=fit["sigma"],
            # C = ∞ (σ = 0 only): Opacus' noise std σ·C would be 0·∞ = nan; the largest float clips nothing too.
            max_grad_norm=min(self.max_grad_norm, sys.float_info.max),
            expected_batch_size=fit["batch_size"],
            generator=generator,
        )
        accountant = create_accountant(mechanism=self.accountant)
        accountant.history = [tuple(h) for h in ctx.state.get("history", [])]
        dp.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=fit["q"]))
        trainer.strategy.optimizers = [dp]
        self._attached = (hooks, optimizer, accountant, inplace)

    def _detach(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Record the steps taken, remove Opacus' hooks and attributes, give the Trainer its plain optimiser back."""
        if self._attached is None:
            return
        hooks, optimizer, accountant, inplace = self._attached
        self._attached = None
        if hooks is None:  # the plain-SGD fit (σ = 0, C = ∞): its steps are still history (ε = ∞ from the first)
            state = self.fit_context.state
            history = add_steps(state.get("history", []), 0.0, self._fit["q"], self._plain_steps)
            state["history"] = [[float(s), float(q), int(n)] for s, q, n in history]
            return
        # Every noised step counts, even if the fit then fails: privacy was spent.
        self.fit_context.state["history"] = [[float(s), float(q), int(n)] for s, q, n in accountant.history]
        hooks.cleanup()
        for p in pl_module.parameters():
            if hasattr(p, "summed_grad"):
                del p.summed_grad
        for m in inplace:
            m.inplace = True
        trainer.strategy.optimizers = [optimizer]

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._attached is not None and self._attached[0] is None:
            self._plain_steps += 1  # one optimiser step per batch (gradient accumulation is refused)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._detach(trainer, pl_module)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._detach(trainer, pl_module)

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        fit = self._fit
        history = ctx.state.get("history", [])
        eps = epsilon(history, fit["delta"], self.accountant)
        exhausted = False
        if self.max_epsilon is not None:  # would the same fit again pass the budget? (the server counts it)
            nxt = epsilon(add_steps(history, fit["sigma"], fit["q"], fit["steps"]), fit["delta"], self.accountant)
            exhausted = nxt > self.max_epsilon
            if exhausted:
                warnings.warn(
                    f"DPSGD: client {ctx.client_id!r} reached ε={eps:.4g}; its next fit would pass max_epsilon="
                    f"{self.max_epsilon}, so it will not train again",
                    stacklevel=2,
                )
        self.put_payload(
            reply,
            {
                "epsilon": eps,
                "delta": fit["delta"],
                "noise_multiplier": fit["sigma"],
                "sample_rate": fit["q"],
                "steps": sum(int(h[2]) for h in history),
                "exhausted": exhausted,
            },
        )
        self._fit = None
