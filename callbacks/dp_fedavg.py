"""DP-FedAvg: client-level differential privacy by clipped updates and Gaussian noise, with an RDP accountant."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import trainable_names
from fl_lightning.errors import PreconditionError, StopFederation
from fl_lightning.models.layer_kinds import tracks_running_stats
from fl_lightning.ops.dp_fedavg import (
    History,
    add_round,
    calibrate_noise_multiplier,
    epsilon,
    fixed_denominator_mean,
    gaussian_noise,
    geometric_clip_update,
    noise_seed,
    noised_unclipped_fraction,
    private_state,
    update_noise_multiplier,
)
from fl_lightning.ops.dp_meaning import warn_if_large
from fl_lightning.ops.sampling import num_selected

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, ModelGroup, RuntimeView, ServerView
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Reply, Task

DOCS_PAGE = "docs/methods/dp-fedavg.md, 'Choosing σ, C and the learning rate'"


def _check_no_running_statistics(module: L.LightningModule) -> list[str]:
    """The trainable parameter names; refuses normalisation layers that track running statistics.

    Buffers do not travel under DP-FedAvg (the client sends them back as received), so BatchNorm's running mean
    and variance would never be learnt; clipping and noising them instead could turn a variance negative.
    """
    tracking = [n for n, m in module.named_modules() if tracks_running_stats(m)]
    if tracking:
        raise PreconditionError(
            f"DPFedAvg protects the trainable parameters only; {tracking[:3]} track running statistics (buffers "
            "learnt from each site's data that would leave it unprotected): set model.norm=group (or none)"
        )
    return trainable_names(module)


class DPFedAvg(FederatedCallback):
    """Client-level DP-FedAvg (McMahan et al., ICLR 2018) with optional adaptive clipping (Andrew et al., 2021).

    **Client half.** Client i sends w + Δ̃_i with Δ_i = w_i − w and Δ̃_i = Δ_i · min(1, C/‖Δ_i‖₂), one L2 norm over
    all trainable parameters; with ``noise="distributed"`` it adds N(0, σ_Δ²C²/m) itself before the state leaves.
    With adaptive clipping it also sends b_i = 1[‖Δ_i‖ ≤ C] (never the norm).

    **Server half.** w ← w + (Σ_{i∈S} Δ̃_i + N(0, σ_Δ²C² I))/m with the fixed denominator m = clients per round
    (uniform weights: the sum's sensitivity to one client is C; FedAvg's sample weights would make it depend on
    n_i, so ``federation.aggregation=uniform`` is required). A client that fails still counts in m. The central
    noise is left out with ``noise="distributed"`` (the clients added it; valid only when the server sees the sum
    alone, i.e. under secure aggregation). Adaptive clipping: b̄ = (Σ(b_i − ½) + N(0, σ_b²))/m + ½ and
    C ← C·exp(−η_C(b̄ − γ)) for the next round; σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) keeps the round at multiplier σ.

    **Accounting.** Each round is the sampled Gaussian mechanism (q = m/N, σ); Opacus' RDP accountant composes
    the rounds and reports ε at δ as ``privacy/epsilon`` per round and in ``summary.json``. The client sampling is
    a fixed-size draw without replacement, analysed as Poisson sampling at q (as McMahan et al. and TFF do; exact
    for q = 1). ``target_epsilon`` calibrates σ for ``federation.rounds``; ``max_epsilon`` stops the run before
    the round that would pass it. δ defaults to 1/(10 N); δ ≥ 1/N is refused (it would allow leaking one client).

    What is not covered: the model's buffers (refused: use GroupNorm), the reply's counts and training loss
    (reported in the clear, as in FedAvg). The noise is a function of ``noise_seed`` (default: the run seed, written
    to ``config.yaml``): whoever knows it can subtract the noise, so a deployment sets a secret one.

    Args:
        noise_multiplier: σ ≥ 0 (the round's total multiplier; 0 = clipping only, ε = ∞).
        target_epsilon: Instead of σ: calibrate σ so that ε after ``federation.rounds`` rounds is ≤ this, within 0.5 %.
        clip_norm: C > 0, the (initial) L2 bound of an update; ``None`` or ``inf`` = no clipping (only with σ = 0).
        noise: ``central`` (the server noises the sum) or ``distributed`` (each client noises its update).
        delta: δ of the reported (ε, δ); default 1/(10 N) for N clients; must be < 1/N.
        max_epsilon: Stop before the round whose ε would exceed this.
        adaptive_clipping: Adapt C towards the ``target_quantile`` of the update norms (Andrew et al. 2021).
        target_quantile: γ ∈ [0, 1], the fraction of updates meant to fall inside C.
        clip_lr: η_C > 0 of the geometric update.
        clip_count_stddev: σ_b ≥ 0 of the bit count's noise; default m/20 (the paper's); must exceed σ/2.
        noise_seed: Seed of the noise generators (default: the run's seed).

    """

    server_step = "dp_fedavg"  # the noised fixed-denominator step; no other server step may follow it unseen

    def __init__(
        self,
        *,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        clip_norm: float | None = 1.0,
        noise: Literal["central", "distributed"] = "central",
        delta: float | None = None,
        max_epsilon: float | None = None,
        adaptive_clipping: bool = False,
        target_quantile: float = 0.5,
        clip_lr: float = 0.2,
        clip_count_stddev: float | None = None,
        noise_seed: int | None = None,
    ) -> None:
        super().__init__()
        unbounded = clip_norm is None or math.isinf(clip_norm)
        checks = {
            "noise_multiplier": noise_multiplier is None or noise_multiplier >= 0,
            "target_epsilon": target_epsilon is None or target_epsilon > 0,
            "clip_norm": unbounded or clip_norm > 0,
            "noise": noise in ("central", "distributed"),
            "delta": delta is None or 0 < delta < 1,
            "max_epsilon": max_epsilon is None or max_epsilon > 0,
            "target_quantile": 0 <= target_quantile <= 1,
            "clip_lr": clip_lr > 0,
            "clip_count_stddev": clip_count_stddev is None or clip_count_stddev >= 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            values = {k: v for k, v in locals().items() if k in bad}
            raise ValueError(f"DPFedAvg: invalid {', '.join(bad)}: {values}")
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("DPFedAvg: set exactly one of noise_multiplier and target_epsilon")
        if unbounded and (target_epsilon is not None or noise_multiplier):
            raise ValueError("DPFedAvg: noise_multiplier > 0 or target_epsilon needs a finite clip_norm (noise is σC)")
        if unbounded and adaptive_clipping:
            raise ValueError("DPFedAvg: adaptive_clipping needs a finite initial clip_norm")
        self.noise_multiplier, self.target_epsilon = noise_multiplier, target_epsilon
        self.noise, self.delta = noise, delta
        self.initial_clip = None if unbounded else float(clip_norm)
        self.max_epsilon, self.adaptive = max_epsilon, adaptive_clipping
        self.target_quantile, self.clip_lr, self.clip_count_stddev = target_quantile, clip_lr, clip_count_stddev
        self.noise_seed = noise_seed
        # server state (checkpointed): σ as calibrated, the current C, the accountant's history
        self.sigma: float | None = noise_multiplier
        self.clip: float | None = self.initial_clip
        self.history: History = []
        self.round_clip = self.initial_clip  # the C of the latest round (C is updated after it)
        self._round = 0
        self._replies = self._bits = 0
        self._names: list[str] = []  # server half: the trainable parameters
        self._client_names: list[str] = []  # client half: the same, of the runtime's module

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: ServerView) -> None:
        cfg = server.config
        if len(server.groups) != 1 or cfg.topology != "star":
            raise PreconditionError("DPFedAvg needs one global model (one group, federation.topology=star)")
        if cfg.aggregation != "uniform":
            raise PreconditionError(
                "DPFedAvg averages with a fixed denominator (uniform weights; sample weights would make one client's "
                "influence depend on its size): set federation.aggregation=uniform"
            )
        self._names = _check_no_running_statistics(server.module)
        n = len(server.data.client_ids)
        self.m = num_selected(n, cfg.client_fraction, cfg.clients_per_round)
        self.q = self.m / n
        if self.delta is None:
            self.delta = 1 / (10 * n)
        if self.delta >= 1 / n:
            raise ValueError(f"DPFedAvg delta={self.delta} must be below 1/N = {1 / n} for N={n} clients")
        if self.sigma is None:  # not restored from a checkpoint: calibrate for the planned rounds
            self.sigma = calibrate_noise_multiplier(self.target_epsilon, self.delta, self.q, cfg.rounds)
        elif self.target_epsilon is not None:  # restored: σ was calibrated for the rounds the run started with
            planned = epsilon([(self.sigma, self.q, cfg.rounds)], self.delta)
            if planned > self.target_epsilon:
                raise ValueError(
                    f"DPFedAvg target_epsilon={self.target_epsilon}: its σ={self.sigma:.4g} was calibrated for fewer "
                    f"rounds than federation.rounds={cfg.rounds}, which would end at ε={planned:.4g}; a run with a "
                    "target ε cannot be extended on resume. Resume with the rounds it started with, or start a new "
                    "run (noise_multiplier with max_epsilon can run until its budget)"
                )
        self.count_stddev = None
        if self.adaptive:
            self.count_stddev = self.m / 20 if self.clip_count_stddev is None else self.clip_count_stddev
            if self.sigma > 0 and self.count_stddev == 0:
                raise ValueError("DPFedAvg clip_count_stddev=0 leaves the clipping bits un-noised: ε would be ∞")
        try:
            self.sigma_update = update_noise_multiplier(self.sigma, self.count_stddev)
        except ValueError as err:
            raise ValueError(f"DPFedAvg: {err}") from None
        planned = epsilon([(self.sigma, self.q, cfg.rounds)], self.delta)
        what = f"DPFedAvg: the planned {cfg.rounds} rounds at σ={self.sigma:.4g}, q={self.q:.3g}"
        warn_if_large(planned, self.delta, what, DOCS_PAGE, self.max_epsilon)
        if self.max_epsilon is not None and not self.history:
            first = epsilon(add_round([], self.sigma, self.q), self.delta)
            if first > self.max_epsilon:
                raise ValueError(
                    f"DPFedAvg max_epsilon={self.max_epsilon} is below ε={first:.4g} of a single round "
                    f"(σ={self.sigma:.4g}, q={self.q:.4g}, δ={self.delta:.3g}): raise max_epsilon or noise_multiplier"
                )

    def _seed(self, server_seed: int) -> int:
        return server_seed if self.noise_seed is None else self.noise_seed

    @override
    def on_round_start(self, server: ServerView, round_idx: int, selected: list[str]) -> None:
        if self.max_epsilon is not None:
            after = epsilon(add_round(self.history, self.sigma, self.q), self.delta)
            if after > self.max_epsilon:
                now = epsilon(self.history, self.delta)
                raise StopFederation(
                    f"DPFedAvg's privacy budget: round {round_idx + 1} would raise ε from {now:.4g} to {after:.4g} "
                    f"(δ={self.delta:.3g}), past max_epsilon={self.max_epsilon}"
                )
        self._round, self._replies, self._bits = round_idx, 0, 0

    @override
    def configure_task(self, server: ServerView, task: Task) -> None:
        std = self.sigma_update * self.clip / math.sqrt(self.m) if self.noise == "distributed" and self.clip else 0.0
        self.put_payload(task, {"clip_norm": self.clip, "noise_std": std, "bit": self.adaptive})

    @override
    def on_reply(self, server: ServerView, task: Task, reply: Reply, weight: float) -> None:
        self._replies += 1
        if self.adaptive:
            bit = (self.get_payload(reply) or {}).get("unclipped")
            if bit not in (0, 1):
                raise ValueError(f"DPFedAvg: client {reply.client_id!r} sent no clipping bit (got {bit!r})")
            self._bits += int(bit)

    @override
    def on_aggregate(
        self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        out = fixed_denominator_mean(previous, averaged, self._names, self._replies, self.m)
        seed, r = self._seed(server.seed), self._round
        if self.noise == "central" and self.sigma_update > 0:
            std = self.sigma_update * self.clip / self.m  # N(0, σ_Δ²C²) on the sum, divided by m
            noise = gaussian_noise({k: out[k] for k in self._names}, std, noise_seed(seed, r, "server", "update"))
            out.update({k: out[k] + noise[k] for k in self._names})
        self.round_clip = self.clip
        if self.adaptive:  # C for the next round, from this round's noised bits
            frac = noised_unclipped_fraction(
                self._bits, self._replies, self.m, self.count_stddev, noise_seed(seed, r, "server", "count")
            )
            self.clip = geometric_clip_update(self.clip, frac, self.target_quantile, self.clip_lr)
        self.history = add_round(self.history, self.sigma, self.q)
        return out

    @override
    def on_round_end(self, server: ServerView, round_idx: int, metrics: dict[str, Any]) -> None:
        metrics["privacy/epsilon"] = epsilon(self.history, self.delta)
        if self.round_clip is not None:
            metrics["privacy/clip_norm"] = self.round_clip

    @override
    def summary_entries(self, server: ServerView) -> dict[str, Any]:
        return {
            "privacy": {
                "mechanism": "DP-FedAvg: client-level sampled Gaussian, fixed denominator (McMahan et al. 2018)",
                "accountant": "opacus.accountants.RDPAccountant",
                "epsilon": epsilon(self.history, self.delta),
                "delta": self.delta,
                "noise": self.noise,
                "noise_multiplier": self.sigma,
                "update_noise_multiplier": self.sigma_update,
                "target_epsilon": self.target_epsilon,
                "max_epsilon": self.max_epsilon,
                "sample_rate": self.q,
                "clients_per_round": self.m,
                "rounds_accounted": sum(h[2] for h in self.history),
                "clip_norm": self.initial_clip,
                "final_clip_norm": self.clip,
                "adaptive_clipping": self.adaptive,
                "target_quantile": self.target_quantile if self.adaptive else None,
                "clip_lr": self.clip_lr if self.adaptive else None,
                "clip_count_stddev": self.count_stddev,
            }
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "clip": self.clip, "history": [list(h) for h in self.history]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sigma, self.clip = state_dict["sigma"], state_dict["clip"]
        self.history = [(float(s), float(q), int(t)) for s, q, t in state_dict["history"]]

    # ------------------------------------------------------------------ client half
    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        self._client_names = _check_no_running_statistics(runtime.module)

    @override
    def on_client_end(self, ctx: ClientContext, module: L.LightningModule, reply: Reply) -> None:
        task = ctx.payload
        seed = noise_seed(ctx.seed if self.noise_seed is None else self.noise_seed, ctx.round, ctx.client_id, "update")
        clip = task["clip_norm"]
        reply.state, norm = private_state(
            reply.state, ctx.received, self._client_names, clip, task["noise_std"], seed
        )  # new tensors: the runtime's private copy of the local weights is left as trained
        if task["bit"]:
            self.put_payload(reply, {"unclipped": int(clip is None or norm <= clip)})
