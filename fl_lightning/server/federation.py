"""The server: one readable loop over rounds, clients and model groups, talking to clients only through tasks.

The Federation selects clients, sends them tasks (:mod:`fl_lightning.wire.protocol`) through a transport
(:mod:`fl_lightning.wire.transport`), aggregates the replies per model group, runs the callbacks' server halves,
orchestrates evaluation, records the round and checkpoints the server's state together with the client
runtime's. Everything a client holds (data, private state, optimiser state) lives in the
:class:`~fl_lightning.runtime.ClientRuntime` on the other side of the transport.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L

from datamodules.base import FederatedDataModule
from fl_lightning.callback import ModelGroup
from fl_lightning.clients.base import ClientModule
from fl_lightning.config import FederationConfig
from fl_lightning.errors import StopFederation
from fl_lightning.ops import RunningWeightedMean, aggregation_weights, clone_state
from fl_lightning.ops.rng import rng_state, set_rng_state
from fl_lightning.outputs import collapse, records
from fl_lightning.outputs.checkpoint import ClientStateStore, checkpoint_path, write_round_checkpoint
from fl_lightning.outputs.report import RoundReporter
from fl_lightning.outputs.round_record import RoundRecord
from fl_lightning.outputs.run_dir import RunDirectory, json_safe
from fl_lightning.outputs.tracking import RoundTracker
from fl_lightning.server import cross_site, secure_statistics, statistics, weights_file
from fl_lightning.server.core import Server
from fl_lightning.server.cyclic import train_cycle
from fl_lightning.server.directory import ClientDirectory
from fl_lightning.server.evaluation import serving_groups
from fl_lightning.server.groups import pass_on
from fl_lightning.server.reply_check import checked_reply, require_min_clients
from fl_lightning.server.round_choice import RoundChoice
from fl_lightning.server.run_files import new_run_directory, resumed_run_directory, write_final_outputs
from fl_lightning.wire.protocol import POOLED
from fl_lightning.wire.transport import Transport

CHECKPOINT_VERSION = 2  # 2: client state held by the runtime (the client/server boundary)


class Federation(Server):
    """The server's run: trains a client module over the clients of a federated datamodule, round by round.

    Args:
        config: Round settings (the ``federation:`` config section).
        module: The client module template (the initial global state; in process, also the runtime's module).
        datamodule: The clients' data or, where the server holds none, a
            :class:`~fl_lightning.server.directory.ClientDirectory` (see :class:`~.core.Server`).
        trainer: The Trainer; its ``FederatedCallback`` callbacks define the method (their server halves run here).
        transport: What carries the tasks to the clients' runtimes; built by the caller (in one process:
            :func:`fl_lightning.engines.local.local_federation`), so the server never builds a client.
        seed: Seed of client sampling and peer-to-peer order (the run's ``seed_everything``).
        config_text: Resolved config to save in the run directory.
        config_dict: Resolved config for the loggers (its ``trainer.logger`` says how the W&B run is opened:
            :meth:`~fl_lightning.outputs.tracking.RoundTracker.take_from`).
        reporter: Terminal output (default: Rich, enabled by ``config.progress``).

    """

    def __init__(
        self,
        config: FederationConfig,
        module: ClientModule,
        datamodule: FederatedDataModule | ClientDirectory,
        trainer: L.Trainer,
        transport: Transport,
        seed: int = 0,
        config_text: str | None = None,
        config_dict: dict[str, Any] | None = None,
        reporter: RoundReporter | None = None,
    ) -> None:
        super().__init__(config, module, datamodule, trainer, transport, seed)
        self.config_text, self.config_dict = config_text, config_dict
        logger_config = (config_dict or {}).get("trainer", {}).get("logger")
        self.tracker = RoundTracker.take_from(trainer, logger_config)
        self.reporter = reporter or RoundReporter.from_config(config)
        self.client_store = ClientStateStore()  # the clients' states beside the checkpoints (fresh on resume)
        self.run_dir: RunDirectory | None = None
        self.last_evaluation: dict[str, Any] = {}
        self.stopped: str | None = None  # why a callback ended the run early (StopFederation), else None
        self.choice: RoundChoice | None = None  # with a validation split: the round chosen on it (select, patience)
        self.cross_site: dict[str, Any] | None = None  # every client's model on every test set, when the run asks

    # ------------------------------------------------------------------ the run
    def setup(self) -> None:
        """Create the model group(s) from the module's initial weights; prepare the client runtime."""
        cfg = self.config
        if not self.data.client_ids:
            raise ValueError("the datamodule has no clients")
        for cb in self.callbacks:
            cb.prepare_module(self.module, self.data)
        init = clone_state(self.module.state_dict())
        members = [POOLED] if cfg.mode == "centralized" else list(self.data.client_ids)
        self.groups = [ModelGroup("global", init, members)]
        declared = set().union(*(cb.private_keys(self.module) for cb in self.callbacks))
        unknown = declared - set(init)
        if unknown:
            raise KeyError(f"callbacks declared private keys the model does not have: {sorted(unknown)[:5]}")
        has_private = bool(declared) or cfg.mode == "local" or cfg.topology == "peer_to_peer"
        self.choice = RoundChoice.of(self, has_private)
        self.transport.prepare()

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        """Run all rounds (from a checkpoint if ``config.resume`` is set) and the final evaluation.

        Returns:
            The summary that is also written to ``summary.json``.

        """
        if self.config.mode == "evaluate":
            return self.run_evaluation()
        if self.config.mode == "stats":
            return self.run_statistics()
        self.setup()
        cfg = self.config
        run_id = self._open_run_dir()
        self.tracker.start(self.run_dir.path, self.config_dict, run_id=run_id, done_rounds=self.round)
        self.transport.start(self.run_dir.path)
        for cb in self.callbacks:
            cb.on_federation_start(self)
        collapse.warn_clients_without_test(self.data)
        self.reporter.start(cfg.rounds, str(self.run_dir.path), first_round=self.round)
        status = "failed"
        try:
            for r in range(self.round, cfg.rounds):
                early = self.choice.stop_reason() if self.choice else None
                if early is not None:  # also when a resume finds the patience spent: the run ended there
                    self.stopped = early
                    self._finish_stopped(warn=False)
                    break
                try:
                    self.last_evaluation = self.run_round(r)
                except StopFederation as stop:  # raised in on_round_start, before any task of round r: 1..r stand
                    self.stopped = f"stopped before round {r + 1}: {stop}"
                    self._finish_stopped()
                    break
                self.round = r + 1
                if cfg.checkpoint_every and (self.round % cfg.checkpoint_every == 0 or self.round == cfg.rounds):
                    self.save_checkpoint()
            if self.choice is not None:  # the test sets, read once; without a validation split the last round's stands
                self.last_evaluation = self.choice.final_test(self, self.last_evaluation)
                chosen = self.choice.chosen_round or self.round
                metrics = records.final_test_metrics(self.last_evaluation, chosen, self.choice.last_round_test)
                self.tracker.log_final(metrics, self.round)
            if cross_site.wanted(cfg):
                self.cross_site = self.run_cross_site()
            status = "success"
        finally:
            self.reporter.stop()
            self.tracker.finish(status)
            if status != "success":
                self.run_dir.close()  # a failed run writes nothing more: the directory may be resumed (or restarted)
        summary = self.summary()
        write_final_outputs(self.run_dir, summary, cfg.plots, self.module.primary_metric)
        self.reporter.finish(summary, str(self.run_dir.path), self.module.primary_metric)
        self.run_dir.close()
        return summary

    def run_evaluation(self) -> dict[str, Any]:
        """``mode: evaluate``: the model in ``federation.weights`` on every client's test set (and pooled), no training.

        The run directory holds ``config.yaml``, ``summary.json`` (with ``weights``, the file scored) and the final
        table, as a training run's does.
        """
        cfg = self.config
        self.setup()
        self.groups[0].state = weights_file.weights_state(Path(cfg.weights), self.groups[0].state)
        self.run_dir = new_run_directory(
            cfg, self.config_text, self.seed, self.data, cfg.plots and self.transport.simulation
        )
        self.tracker.start(self.run_dir.path, self.config_dict, run_id=None, done_rounds=0)
        self.transport.start(self.run_dir.path)
        status = "failed"
        try:
            self.last_evaluation = self.evaluate(split="test")
            status = "success"
        finally:
            self.tracker.finish(status)
            if status != "success":
                self.run_dir.close()
        summary = {**self.summary(), "weights": cfg.weights}
        write_final_outputs(self.run_dir, summary, False, self.module.primary_metric)
        self.reporter.finish(summary, str(self.run_dir.path), self.module.primary_metric)
        self.run_dir.close()
        return summary

    def run_statistics(self) -> dict[str, Any]:
        """``mode: stats``: every client's released data summaries, per site and pooled (:mod:`.statistics`).

        The run directory holds ``config.yaml``, ``stats.json`` and ``stats.png``; the table is printed unless
        ``quiet``. Nothing is trained and no callback's server half runs.
        """
        cfg = self.config
        self.setup()
        self.run_dir = new_run_directory(cfg, self.config_text, self.seed, self.data, False)
        self.transport.start(self.run_dir.path)
        try:
            opts = cfg.stats_rules()
            if cfg.stats_secure is None:  # as the run's training: secure when a callback hides the clients' updates
                opts["secure"] = any(cb.hides_updates() for cb in self.callbacks)
            clients = list(self.data.client_ids)
            if opts["secure"]:
                pooled, flags, failed, stricter = secure_statistics.collect_secure(
                    self.transport, clients, opts, session=f"{self.run_dir.path.name}/stats"
                )
                rep = secure_statistics.pooled_report(pooled, flags, failed, opts, stricter)
            else:
                released, failed, stricter = statistics.collect(self.transport, clients, opts)
                if not released:
                    raise RuntimeError(f"no client answered the statistics task: {failed}")
                rep = statistics.report(released, failed, opts, stricter)
            self.run_dir.write_json("stats.json", rep)
            if cfg.plots:
                statistics.plot(rep, self.run_dir.path / "stats.png")
            if not cfg.quiet:
                print(statistics.table_text(rep))
                print(f"stats.json in {self.run_dir.path}")
        finally:
            self.run_dir.close()
        return rep

    def run_cross_site(self) -> dict[str, Any]:
        """Every client's own model on every client's test set and pooled (:mod:`.cross_site`).

        Written as ``cross_site.csv`` and (``federation.plots``) ``cross_site.png``; the models the run reports (the
        chosen round's, with ``select: best``).
        """
        chosen = self.choice.chosen_round if self.choice is not None else None
        best = self.choice.best_groups if self.choice is not None else None
        groups, round_ = cross_site.reported_groups(self.groups, self.round, chosen, best)
        ids = list(self.data.client_ids)
        models = cross_site.own_models(self.transport, serving_groups(groups, ids), ids, self.round)
        pooled = self.transport.simulation and hasattr(self.module, "evaluation_parts")
        matrix = cross_site.cross_site_matrix(
            self.transport, models, ids, self.round, "test", self.module if pooled else None
        )
        cross_site.write_cross_site(
            matrix, self.run_dir.path, self.module.primary_metric, round_, plot=self.config.plots
        )
        return matrix

    def _open_run_dir(self) -> str | None:
        """Create the run directory, or reopen the resumed one; returns the logger run id to continue."""
        cfg = self.config
        if not cfg.resume:
            partition = cfg.plots and self.transport.simulation  # a deployment's server does not know the labels
            self.run_dir = new_run_directory(cfg, self.config_text, self.seed, self.data, partition)
            return None

        def restore(state: dict[str, Any]) -> int:
            self.load_state_dict(state)
            return self.round

        self.run_dir, run_id = resumed_run_directory(
            cfg, self.config_dict, self.data.client_ids, restore, self.reporter.note
        )
        return run_id

    def run_round(self, r: int) -> dict[str, Any]:
        """One round: select → fit tasks → aggregate each group's replies → evaluate → record; its evaluation."""
        selected = self.select(r)
        for cb in self.callbacks:
            cb.on_round_start(self, r, selected)  # may raise StopFederation (caught in run)
        record = RoundRecord(r + 1, selected)
        self.reporter.round_start(sum(len([c for c in selected if c in g.members]) for g in self.groups))
        for group in self.groups:
            self.train_group(r, group, [c for c in selected if c in group.members], record)
        if self.config.topology == "peer_to_peer":
            pass_on(self, r)
        record.comm["train"] = self.transport.take_counts()
        with record.timed("eval"):
            if r + 1 == self.config.rounds or (self.config.eval_every and (r + 1) % self.config.eval_every == 0):
                record.evaluation = self.evaluate(self.evaluation_clients(r))
                if self.choice is not None:
                    record.extra.update(self.choice.record(self, r, record.evaluation))
        record.comm["eval"] = self.transport.take_counts()
        self.write_record(record)
        return record.evaluation

    def train_group(self, r: int, group: ModelGroup, members: list[str], record: RoundRecord) -> None:
        """Fit tasks to the group's selected ``members``; their replies enter its mean in the order of ``members``.

        A reply that failed, or that fails the server's checks (:mod:`~fl_lightning.server.reply_check`), is left
        out (warned, and recorded in ``rounds.csv`` and ``metrics.csv``); the others are renormalised.

        Raises:
            RuntimeError: If every member failed, or fewer than ``federation.min_clients`` replied.
        """
        if not members:
            return  # with client sampling, a group may have no member this round
        if self.config.topology == "cyclic":
            train_cycle(self, r, group, members, record, self.reporter.client_done)
            return
        # n_{i,m}: the client's samples in this group (all its samples unless the group holds subsets)
        weights = aggregation_weights([self.num_samples(c, group) for c in members], self.config.aggregation)
        mean = RunningWeightedMean()
        tasks = [self.fit_task(r, group, cid) for cid in members]
        # Replies come back in the order of the tasks (a transport that runs them in parallel reorders them).
        replies = record.timed_each("train", self.transport.stream(tasks))
        expected = self.uploaded_keys(group)
        for cid, weight, task, reply in zip(members, weights, tasks, replies):
            self.reporter.client_done()
            error = reply.error if reply.error is not None else checked_reply(reply, group.state, expected)
            if error is not None:
                warnings.warn(f"client {cid!r} failed and is left out of this round: {error}", stacklevel=3)
                record.failed.append(cid)
                continue
            record.add_reply(cid, reply, self.data.batch_size, self.config.local_steps is not None)
            with record.timed("aggregate"):
                for cb in self.callbacks:
                    cb.on_reply(self, task, reply, weight)
                mean.add(reply.state, weight)
        if not mean.count:  # the round 1-based, as rounds.csv and the terminal count it
            raise RuntimeError(f"round {r + 1}: every selected client of group {group.name!r} failed: {members}")
        require_min_clients(self.config.min_clients, r, group.name, members, mean.count, record.failed)
        with record.timed("aggregate"):
            if self.has_global_model:
                self.aggregate(group, mean)

    def write_record(self, record: RoundRecord) -> None:
        """The round's rows to the run directory and the loggers, the callbacks' additions, the terminal line."""
        cfg, evaluation, n = self.config, record.evaluation, record.round
        evaluated = None
        if cfg.eval_clients is not None:
            evaluated = len(self.evaluated_clients) if evaluation else 0
        round_row = record.row(self.transport.take_round_metrics(), evaluated)
        ids = list(self.data.client_ids)
        rows = records.client_rows(
            n, ids, self._expand(record.selected), self._expand(record.failed), record.trained, evaluation
        )
        self.run_dir.add_rows(rows, round_row)
        per_client = records.per_client_keys(len(ids))  # else one table per round, not N keys
        self.tracker.log_round(
            n,
            records.logged_metrics(round_row, record.trained, evaluation, per_client=per_client),
            clients=None if per_client else records.client_table(record.trained, evaluation),
        )
        recorded = set(round_row)
        for cb in self.callbacks:
            cb.on_round_end(self, n - 1, round_row)
        added = {k: v for k, v in round_row.items() if k not in recorded}
        if added:  # a callback added round metrics (e.g. a clustering's Rand index): record them too
            self.run_dir.rewrite_rounds()
            self.tracker.log_round(n, added)
        line = records.round_line(
            n,
            cfg.rounds,
            record.trained,
            evaluation,
            round_row["time/round"],
            self.module.primary_metric,
            epsilon=records.round_epsilon(round_row),
        )
        self.reporter.round_end(line, records.round_legend(evaluation, self.module.primary_metric))

    def _finish_stopped(self, warn: bool = True) -> None:
        """After a StopFederation (warned) or early stopping (noted): evaluate the last models if not, checkpoint."""
        if warn:
            warnings.warn(self.stopped, stacklevel=3)
        self.reporter.note(self.stopped)
        if not self.last_evaluation:
            self.last_evaluation = self.evaluate()
        if self.config.checkpoint_every and self.round and self.round % self.config.checkpoint_every:
            self.save_checkpoint()  # the last round was not checkpointed yet

    def summary(self) -> dict[str, Any]:
        """The final evaluation table (what ``summary.json`` holds)."""
        evaluation = self.last_evaluation
        meta = {
            "run_dir": str(self.run_dir.path),
            "mode": self.config.mode,
            "topology": self.config.topology,
            "rounds": self.round,
            "methods": [type(cb).__name__ for cb in self.callbacks] or ["FedAvg"],
        }
        if self.stopped is not None:
            meta["stopped"] = self.stopped
        if self.choice is not None:
            meta.update(self.choice.summary_entries(self.round))
        for cb in self.callbacks:
            meta.update(cb.summary_entries(self))
        test_samples = {c: self.data.num_test_samples(c) for c in self.data.client_ids}
        pooled = sum(test_samples.values()) if "pooled" in evaluation else None
        if "node_matrix" in evaluation:
            meta["node_matrix"] = evaluation["node_matrix"]

        return json_safe(
            records.summary_table(
                evaluation,
                test_samples,
                pooled,
                meta,
                self.run_dir.client_rows,
                num_classes=getattr(self.data, "num_classes", None),  # a ClientDirectory does not say
            )
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run exactly: the server's state and the client runtime's."""
        return {
            "version": CHECKPOINT_VERSION,
            "round": self.round,
            "groups": [
                {"name": g.name, "state": g.state, "members": list(g.members), "subsets": g.subsets}
                for g in self.groups
            ],
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "runtime": self.transport.runtime_state(),
            "rng": rng_state(),
            "evaluation": self.last_evaluation,
            # only the counts: the rows are in the run directory's CSVs (storing them made every checkpoint
            # O(rounds x clients)); a resume cuts the CSVs back to these counts
            "row_counts": {"clients": len(self.run_dir.client_rows), "rounds": len(self.run_dir.round_rows)},
            "logger_run_id": self.tracker.run_id(),
            "selection": None if self.choice is None else self.choice.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after :meth:`setup`, which built the module and groups).

        Raises:
            ValueError: If the checkpoint was written by another version or for other callbacks.

        """
        if state.get("version") != CHECKPOINT_VERSION:
            raise ValueError(
                f"checkpoint version {state.get('version')} is not {CHECKPOINT_VERSION} (version 1 checkpoints, "
                "written before the client/server boundary, cannot be resumed by this version)"
            )
        saved_cbs, our_cbs = set(state["callbacks"]), {cb.state_key for cb in self.callbacks}
        if saved_cbs != our_cbs:
            raise ValueError(f"checkpoint callbacks {sorted(saved_cbs)} differ from the configured {sorted(our_cbs)}")
        self.round = int(state["round"])
        self.groups = [ModelGroup(g["name"], g["state"], list(g["members"]), g.get("subsets")) for g in state["groups"]]
        self.module.load_state_dict(self.groups[0].state)  # fails loudly if the architecture changed
        for cb in self.callbacks:
            cb.load_state_dict(state["callbacks"][cb.state_key])
        self.transport.load_runtime_state(state["runtime"])
        set_rng_state(state["rng"])
        self.last_evaluation = state["evaluation"]
        saved = state.get("selection")  # absent in checkpoints written before the validation split existed
        if self.choice is not None and saved is not None:
            self.choice.load_state_dict(saved)

    def save_checkpoint(self) -> Path:
        """Write the round checkpoint atomically (the clients' states only where changed), prune old ones; its path."""
        path = checkpoint_path(self.run_dir.path, self.round)
        self.run_dir.sync()  # the rows the checkpoint counts are on disk before it is
        write_round_checkpoint(path, self.state_dict(), self.client_store, self.config.keep_checkpoints)
        return path
