"""The ``federation:`` section of a config: everything about rounds that is not model, data or Trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# The data's shape, linked from ``data`` into the model's arguments of the same name (a model that does not take one
# is left without it); left out of the saved config and of its comparison on resume.
DATA_SHAPE_LINKS = ("num_classes", "in_channels", "image_size", "num_features")


@dataclass
class FederationConfig:
    """Settings of the federated rounds.

    Args:
        rounds: Number of communication rounds.
        local_epochs: Local epochs per selected client per round (ignored when ``local_steps`` is set).
        local_steps: Local optimiser steps per selected client per round instead of epochs (each
            client draws exactly this many batches, cycling through its data).
        client_fraction: Fraction of clients sampled each round (at least one); 1.0 = all.
        clients_per_round: Number of clients sampled each round; overrides ``client_fraction``.
        aggregation: Aggregation weights: ``samples`` (n_i / n, FedAvg) or ``uniform``.
        mode: ``federated`` (the callbacks' method, FedAvg by default), ``local`` (every client
            trains alone, no communication), ``centralized`` (all training data pooled in one model) or ``evaluate``
            (no training: the model in ``weights`` scored on every client's test set) or ``stats`` (no training:
            federated statistics of every client's data, ``stats.json``; ``python -m fl_lightning.stats``).
        weights: ``mode: evaluate``: the weights file to score, a round checkpoint (``checkpoints/round-*.ckpt``),
            a Lightning checkpoint or a state dict saved with ``torch.save``; loaded with ``weights_only=True``.
        topology: ``star`` (a server aggregates), ``peer_to_peer`` (no server: each node passes
            its model to a random successor every round) or ``cyclic`` (cyclic weight transfer: one model visits the
            round's clients one after another, each training what the previous one passed on; no averaging; the
            round's model is the last client's).
        cycle_order: The order of a cyclic round: ``random`` (a fresh seeded permutation each round, the default)
            or ``fixed`` (the clients' order in the data every round; FLamby's ``deterministic_cycle``).
        keep_optimizer_state: Keep each client's optimiser state (e.g. momentum) across rounds
            instead of a fresh optimiser per fit. Always on in ``local`` and ``centralized`` mode.
        eval_every: Evaluate every this many rounds (0 = only after the last round).
        eval_clients: Clients evaluated on an evaluation round other than the last: ``null`` (default) = all;
            a float in (0, 1] = that fraction of the clients (at least one); an int >= 1 = that many (at most
            all). The sample is drawn anew each round, seeded by ``seed_everything`` and the round (like client
            selection), so per-round evaluation costs in proportion to the sample, not to all clients. The last
            round always evaluates every client (``summary.json`` is always over all clients). Per-client means,
            worst clients and pooled metrics of a sampled round are over the sampled clients; the rows of the
            others stay empty in ``metrics.csv``. Evaluation never trains: the weights do not depend on it.
        select: Which round's models the final test evaluation scores: ``last`` (default) or ``best``, the round
            whose ``monitor`` value on the validation split was best. Needs a validation split
            (``data.init_args.val_fraction`` > 0, or data with an official one). With a validation split, evaluation
            rounds score the validation sets only and every client's test set is read once, after the last round:
            for the chosen round's models and, when that is not the last round, for the last round's too.
        monitor: The validation metric that chooses the round and drives ``patience``: ``val/[<model>/]<metric>
            [_mean|_worst|_std]`` (``<model>``: ``global`` (default), ``personal`` or a callback's model) or
            ``val/pooled/<metric>``, e.g. ``val/acc_mean``, ``val/acc_worst``, ``val/personal/dice_mean``,
            ``val/loss``. Loss and HD95 are minimised, everything else maximised. Default: the module's primary metric,
            client mean, on the global model (the personal one where there is no global model).
        patience: Early stopping: end the run when this many evaluation rounds in a row have not improved the
            monitored validation metric (``null``, the default: never). The round chosen by ``select`` stands.
        cross_site: Score every client's own model (its group's model with its private state; in ``local`` mode its
            whole model) on every client's test set and on all of them pooled after the last round, written as
            ``cross_site.csv`` and ``cross_site.png``: ``null`` (default) in ``local`` mode only, ``true`` in any
            star or cyclic run, ``false`` never. With ``select: best`` it scores the chosen round's models.
        output_dir: Parent directory of run directories.
        run_name: Name of this run's directory (default: a timestamp and the mode).
        progress: The live progress bar over rounds and clients: ``true`` always, ``false`` never, ``null``
            (default) only when stdout is a terminal, so batch logs (SLURM, ``> log.txt``) hold no bar frames.
            The run directory, one plain line per round and the final table are printed either way.
        quiet: Print nothing at all (no bar, run directory, round lines or final table); warnings still go
            to stderr. Wins over ``progress``.
        plots: Write ``partition.png`` and ``sites.png`` (example images per client) at the start and
            ``curves.png`` (plus ``node_matrix.png`` in peer-to-peer runs and ``cross_site.png`` with cross-site
            evaluation) at the end into the run directory; ``false`` writes no figure at all.
        checkpoint_every: Write a round checkpoint (``checkpoints/round-NNNNN.ckpt`` in the run directory)
            every this many rounds and after the last round (0 = never; such a run cannot be resumed).
        keep_checkpoints: How many of the newest round checkpoints to keep (0 = keep all).
        resume: Continue a run from its round checkpoint instead of starting a new one: ``last`` (the newest
            readable checkpoint of ``output_dir/run_name``), a run directory or a checkpoint file; the
            README's "Checkpoints and exact resume" says what must stay the same.
        transport: How tasks reach the client runtime: ``inprocess`` (direct calls, the fast path) or
            ``serialized`` (every task and reply is encoded to bytes and decoded, and the client runtime
            holds its own copies of module, data and callbacks: proves that only messages cross the line).
        workers: Processes to run the clients on (torch.distributed; rank 0 is also the server). ``N > 1`` starts
            them on this machine (``train.py`` is rank 0 itself and starts ranks 1 … N − 1 before it imports
            torch); under ``torchrun`` (or SLURM's ``srun`` + torchrun) the launcher's ranks are used.
        workers_per_device: Ranks that share one GPU (rank r uses ``cuda:(local_rank // workers_per_device)``).
        rank_timeout: Seconds rank 0 waits for a rank's answer (and a rank for rank 0's next message) before the
            run stops with an error naming it.
        min_clients: A round (each model group's fit wave, or a cycle) goes on without clients that failed (their
            fit raised, their reply failed the server's checks, or their site did not answer in time) as long as at
            least this many of its selected clients replied (all of them if fewer were selected); else the run stops
            with an error naming the failed ones. The default 1 stops only when nobody answered.
        reply_timeout: Seconds a Flower site may take to answer one task before its client counts as failed for
            that round (None: the Flower run config's ``timeout``, 3600 s). In one process and across ranks there is
            no site to wait for (``rank_timeout`` stops a run whose rank hangs).
        stats_min_count: ``mode: stats``: a split of fewer samples, or a count cell (a class, a histogram bin) of
            fewer than this many, is withheld by the site.
        stats_bins: ``mode: stats``: bins of the intensity histogram over [0, 1].
        stats_epsilon: ``mode: stats``: Gaussian noise added at each site so that its release is
            (ε, ``stats_delta``)-differentially private per sample (None: no noise).
        stats_delta: ``mode: stats``: the δ of ``stats_epsilon``.
        stats_secure: ``mode: stats``: the sites mask their summaries so that the server learns only the pooled
            sums (secure aggregation; small cells are then withheld from the pooled cells). None: when the run's
            callbacks hide clients' updates (``SecureAggregation``). A site whose own config says true refuses to
            answer in the clear.

    """

    rounds: int = 10
    local_epochs: int = 1
    local_steps: int | None = None
    client_fraction: float = 1.0
    clients_per_round: int | None = None
    aggregation: Literal["samples", "uniform"] = "samples"
    mode: Literal["federated", "local", "centralized", "evaluate", "stats"] = "federated"
    weights: str | None = None
    topology: Literal["star", "peer_to_peer", "cyclic"] = "star"
    cycle_order: Literal["random", "fixed"] = "random"
    keep_optimizer_state: bool = False
    eval_every: int = 1
    eval_clients: int | float | None = None
    select: Literal["last", "best"] = "last"
    monitor: str | None = None
    patience: int | None = None
    cross_site: bool | None = None
    output_dir: str = "runs"
    run_name: str | None = None
    progress: bool | None = None
    quiet: bool = False
    plots: bool = True
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    resume: str | None = None
    transport: Literal["inprocess", "serialized"] = "inprocess"
    workers: int = 1
    workers_per_device: int = 1
    rank_timeout: float = 1800.0
    min_clients: int = 1
    reply_timeout: float | None = None
    stats_min_count: int = 10
    stats_bins: int = 16
    stats_epsilon: float | None = None
    stats_delta: float = 1e-5
    stats_secure: bool | None = None

    def stats_rules(self) -> dict[str, Any]:
        """The release rules of ``mode: stats`` (a stats task carries the server's; a site applies the stricter).

        ``secure`` is ``stats_secure`` (None counts as false here: the server resolves it from the callbacks).
        """
        return {"secure": bool(self.stats_secure), "min_count": self.stats_min_count, "bins": self.stats_bins,
                "epsilon": self.stats_epsilon, "delta": self.stats_delta}  # fmt: skip

    def __post_init__(self) -> None:
        checks = {
            "rounds": self.rounds >= 1,
            "local_epochs": self.local_epochs >= 1,
            "local_steps": self.local_steps is None or self.local_steps >= 1,
            "client_fraction": 0 < self.client_fraction <= 1,
            "clients_per_round": self.clients_per_round is None or self.clients_per_round >= 1,
            "eval_every": self.eval_every >= 0,
            "eval_clients": _valid_eval_clients(self.eval_clients),
            "patience": self.patience is None or self.patience >= 1,
            "checkpoint_every": self.checkpoint_every >= 0,
            "keep_checkpoints": self.keep_checkpoints >= 0,
            "workers": self.workers >= 1,
            "workers_per_device": self.workers_per_device >= 1,
            "rank_timeout": self.rank_timeout > 0,
            "min_clients": self.min_clients >= 1,
            "reply_timeout": self.reply_timeout is None or self.reply_timeout > 0,
            "stats_min_count": self.stats_min_count >= 1,
            "stats_bins": self.stats_bins >= 1,
            "stats_epsilon": self.stats_epsilon is None or self.stats_epsilon > 0,
            "stats_delta": 0 < self.stats_delta < 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"federation.{k}={getattr(self, k)!r}" for k in bad)
            raise ValueError(f"invalid federation settings: {values}")
        if (self.mode == "evaluate") != (self.weights is not None):
            raise ValueError(
                "federation.mode=evaluate and federation.weights go together: give the weights file to evaluate "
                f"with mode evaluate (got mode={self.mode!r}, weights={self.weights!r})"
            )
        if self.topology != "star" and self.mode != "federated":
            raise ValueError(f"federation.topology={self.topology} needs federation.mode=federated, got {self.mode!r}")


def _valid_eval_clients(value: int | float | None) -> bool:
    """``None``, an int >= 1 (a count) or a float in (0, 1] (a fraction); never a bool."""
    if value is None:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1
    return isinstance(value, float) and 0 < value <= 1
