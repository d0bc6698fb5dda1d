"""The server: one readable loop over rounds, clients and model groups, talking to clients only through tasks.

The Federation selects clients, sends them tasks (:mod:`fl_lightning.protocol`) through a transport
(:mod:`fl_lightning.transport`), aggregates the replies per model group, runs the callbacks' server halves,
orchestrates evaluation, records the round and checkpoints the server's state together with the client
runtime's. Everything a client holds (data, private state, optimiser state) lives in the
:class:`~fl_lightning.runtime.ClientRuntime` on the other side of the transport.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

from datamodules.base import FederatedDataModule
from fl_lightning import collapse, protocol, records
from fl_lightning.callback import FederatedCallback, check_composition
from fl_lightning.checkpoint import ClientStateStore, checkpoint_path, rng_state, set_rng_state, write_round_checkpoint
from fl_lightning.clients.base import ClientModule
from fl_lightning.config import FederationConfig
from fl_lightning.environment import environment_record
from fl_lightning.errors import StopFederation
from fl_lightning.evaluation import evaluate_nodes, summarise
from fl_lightning.groups import split_by_clients, split_by_samples
from fl_lightning.ops import RunningWeightedMean, aggregation_weights, clone_state
from fl_lightning.ops.state import StateDict
from fl_lightning.plots import domain_counts, plot_curves, plot_node_matrix, plot_partition
from fl_lightning.protocol import Task
from fl_lightning.report import RoundReporter
from fl_lightning.resume import check_clients_match, check_resume_config, resolve_resume
from fl_lightning.run_dir import RunDirectory, json_safe
from fl_lightning.runtime import POOLED, ClientRuntime
from fl_lightning.selection import evaluated_clients, random_cycle, training_clients
from fl_lightning.state import ModelGroup
from fl_lightning.tracking import RoundTracker
from fl_lightning.transport import Transport, make_transport

CHECKPOINT_VERSION = 2  # 2: client state held by the runtime (the client/server boundary)


class Federation:
    """The server: trains a client module over the clients of a federated datamodule through a client runtime.

    Args:
        config: Round settings (the ``federation:`` config section).
        module: The client module template (the initial global state; in-process, also the runtime's module).
        datamodule: The clients' data. The server reads only its metadata (client ids, sample counts, the
            partition for ``partition.png``); training and evaluation happen in the runtime.
        trainer: The Trainer; its ``FederatedCallback`` callbacks define the method (their server halves run here).
        seed: Seed of client sampling and peer-to-peer order (the run's ``seed_everything``).
        config_text: Resolved config to save in the run directory.
        config_dict: Resolved config for the loggers.
        reporter: Terminal output (default: Rich, enabled by ``config.progress``).
        runtime_factory: Builds the client runtime of the ``serialized`` transport from its own copies of
            config and data (the CLI re-instantiates them); default: deep copies of module, data and Trainer.
        transport: A ready transport instead of the one ``config.transport`` names (e.g. a relay through
            another federation); ``datamodule`` may then be a :class:`~fl_lightning.directory.ClientDirectory`.

    """

    def __init__(
        self,
        config: FederationConfig,
        module: ClientModule,
        datamodule: FederatedDataModule,
        trainer: L.Trainer,
        seed: int = 0,
        config_text: str | None = None,
        config_dict: dict[str, Any] | None = None,
        reporter: RoundReporter | None = None,
        runtime_factory: Callable[[], ClientRuntime] | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.config, self.module, self.data, self.trainer, self.seed = config, module, datamodule, trainer, seed
        self.config_text, self.config_dict = config_text, config_dict
        self.tracker = RoundTracker.take_from(trainer)
        self.reporter = reporter or RoundReporter.from_config(config)
        self.callbacks = [cb for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
        self._check_mode()
        self._check_callbacks()
        self.transport = transport or make_transport(
            config, module, datamodule, trainer, seed, note=self.reporter.note, runtime_factory=runtime_factory
        )
        self.groups: list[ModelGroup] = []
        self.round = 0
        self.client_store = ClientStateStore()  # the clients' states beside the checkpoints (fresh on resume)
        self.run_dir: RunDirectory | None = None
        self.last_evaluation: dict[str, Any] = {}
        self.evaluated_clients: list[str] = []  # the clients of the latest evaluation
        self.stopped: str | None = None  # why a callback ended the run early (StopFederation), else None

    # ------------------------------------------------------------------ set-up
    def _check_mode(self) -> None:
        cfg = self.config
        if cfg.mode != "federated" and self.callbacks:
            names = [type(cb).__name__ for cb in self.callbacks]
            raise ValueError(
                f"federation.mode={cfg.mode} is a reference mode without communication; "
                f"remove the federated callbacks {names} from trainer.callbacks"
            )

    def _check_callbacks(self) -> None:
        keys = [cb.state_key for cb in self.callbacks]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(
                f"trainer.callbacks holds {twice} more than once; a method's two instances would both act on every "
                "client (e.g. FedProx twice adds two proximal terms): configure each method once"
            )
        check_composition(self.callbacks)

    @property
    def device(self) -> torch.device:
        """Device of the server's Trainer."""
        return self.trainer.strategy.root_device

    @property
    def has_global_model(self) -> bool:
        """Whether a server-side global model exists (not in local-only or peer-to-peer runs)."""
        return self.config.mode != "local" and self.config.topology == "star"

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
        self.transport.prepare()

    # ------------------------------------------------------------------ simulation introspection
    @property
    def runtime(self) -> ClientRuntime:
        """The client runtime behind the transport (simulation only; a deployment has no such object here)."""
        return self.transport.runtime

    @property
    def private(self) -> dict[tuple[str, str], StateDict]:
        """Simulation introspection: the runtime's private states keyed ``(group, client)``."""
        return {(g, c): st for c, groups in self.runtime.private.items() for g, st in groups.items()}

    @property
    def optimizer_states(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Simulation introspection: the runtime's kept optimiser states keyed ``(group, client)``."""
        return {(g, c): st for c, groups in self.runtime.optimizer_states.items() for g, st in groups.items()}

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        """Run all rounds (from a checkpoint if ``config.resume`` is set) and the final evaluation.

        Returns:
            The summary that is also written to ``summary.json``.

        """
        self.setup()
        cfg = self.config
        run_id = self._open_run_dir()
        self.tracker.start(self.run_dir.path, self.config_dict, run_id=run_id)
        self.transport.start(self.run_dir.path)
        for cb in self.callbacks:
            cb.on_federation_start(self)
        collapse.warn_clients_without_test(self.data)
        self.reporter.start(cfg.rounds, str(self.run_dir.path), first_round=self.round)
        status = "failed"
        try:
            for r in range(self.round, cfg.rounds):
                try:
                    self.last_evaluation = self.run_round(r)
                except StopFederation as stop:  # raised in on_round_start, before any task of round r: 1..r stand
                    self.stopped = f"stopped before round {r + 1}: {stop}"
                    self._finish_stopped()
                    break
                self.round = r + 1
                if cfg.checkpoint_every and (self.round % cfg.checkpoint_every == 0 or self.round == cfg.rounds):
                    self.save_checkpoint()
            status = "success"
        finally:
            self.reporter.stop()
            self.tracker.finish(status)
            if status != "success":
                self.run_dir.close()  # a failed run writes nothing more: the directory may be resumed (or restarted)
        summary = self.summary()
        self.run_dir.write_summary(summary)
        collapse.warn_collapse(summary)
        if cfg.plots:
            plot_curves(self.run_dir.client_rows, self.run_dir.path / "curves.png", self.module.primary_metric)
            if "node_matrix" in summary:
                plot_node_matrix(
                    summary["node_matrix"], self.run_dir.path / "node_matrix.png", self.module.primary_metric
                )
        self.reporter.finish(summary, str(self.run_dir.path), self.module.primary_metric)
        self.run_dir.close()
        return summary

    def _open_run_dir(self) -> str | None:
        """Create the run directory, or reopen the resumed one; returns the logger run id to continue."""
        cfg = self.config
        if cfg.resume:
            path, ckpt_path, state = resolve_resume(cfg.resume, cfg.output_dir, cfg.run_name, self.config_dict)
            check_clients_match(state, self.data.client_ids)
            changes = check_resume_config(path, self.config_dict)  # the allow-listed changes, to record
            self.load_state_dict(state)
            if "rows" in state:  # written before checkpoints held only the row counts: the rows themselves
                self.run_dir = RunDirectory.reopen(path, state["rows"]["clients"], state["rows"]["rounds"])
            else:  # the CSVs are the source, cut back to what this checkpoint counts
                self.run_dir = RunDirectory.resume(path, state["row_counts"])
            self.run_dir.record_resume(ckpt_path, self.round, changes)
            self.reporter.note(f"resuming from {ckpt_path} after round {self.round}")
            if cfg.rounds <= self.round:
                warnings.warn(
                    f"federation.rounds={cfg.rounds} but the checkpoint is after round {self.round}: no round is "
                    f"trained, only the final evaluation of round {self.round}'s models runs (raise "
                    "federation.rounds to continue training)",
                    stacklevel=2,
                )
            return state.get("logger_run_id")
        self.run_dir = RunDirectory(cfg.output_dir, cfg.run_name, suffix=cfg.mode)
        if self.config_text is not None:
            self.run_dir.write_config(self.config_text)
        self.run_dir.write_json("environment.json", environment_record(self.seed))
        if cfg.plots and self.transport.simulation:  # a deployment's server does not know the sites' labels
            ids = list(self.data.client_ids)
            counts = {c: self.data.label_counts(c).numpy() for c in ids}
            unit = "pixels" if self.data.client_data(ids[0]).train_y.ndim > 1 else "samples"  # masks count pixels
            plot_partition(counts, self.run_dir.path / "partition.png", domain_counts(self.data), unit)
        return None

    def run_round(self, r: int) -> dict[str, Any]:
        """One round: select → fit tasks → aggregate each group's replies → evaluate → record."""
        cfg = self.config
        t_round = time.perf_counter()
        # --- select
        selected = self.select(r)
        for cb in self.callbacks:
            cb.on_round_start(self, r, selected)  # may raise StopFederation (caught in run)
        self.reporter.round_start(sum(len([c for c in selected if c in g.members]) for g in self.groups))
        # --- local training and streaming aggregation, per group; replies in the order of the selection
        trained: dict[str, dict[str, Any]] = {}
        failed: list[str] = []
        t_train = t_agg = 0.0
        samples = 0
        for group in self.groups:
            members = [c for c in selected if c in group.members]
            if not members:
                continue  # with client sampling, a group may have no member this round
            # n_{i,m}: the client's samples in this group (all its samples unless the group holds subsets)
            weights = aggregation_weights([self.num_samples(c, group) for c in members], cfg.aggregation)
            mean = RunningWeightedMean()
            tasks = [self.fit_task(r, group, cid) for cid in members]
            # Replies come back in the order of the tasks (a transport that runs them in parallel reorders them).
            t0 = time.perf_counter()
            for cid, weight, task, reply in zip(members, weights, tasks, self.transport.stream(tasks)):
                t_train += time.perf_counter() - t0
                self.reporter.client_done()
                if reply.error is not None:
                    warnings.warn(f"client {cid!r} failed and is left out of this round: {reply.error}", stacklevel=2)
                    failed.append(cid)
                    continue
                samples += records.samples_trained(reply, self.data.batch_size, cfg.local_steps is not None)
                trained[cid] = {"train_samples": reply.num_samples, "train_steps": reply.num_steps, **reply.metrics}
                t0 = time.perf_counter()
                for cb in self.callbacks:
                    cb.on_reply(self, task, reply, weight)
                mean.add(reply.state, weight)
                t_agg += time.perf_counter() - t0
                t0 = time.perf_counter()
            if not mean.count:
                raise RuntimeError(f"round {r}: every selected client of group {group.name!r} failed: {members}")
            t0 = time.perf_counter()
            if self.has_global_model:
                self.aggregate(group, mean)
            t_agg += time.perf_counter() - t0
        if cfg.topology == "peer_to_peer":
            self.pass_on(r)
        bytes_down, bytes_up = self.transport.take_counts()
        # --- evaluate
        t0 = time.perf_counter()
        is_last = r + 1 == cfg.rounds
        evaluation: dict[str, Any] = {}
        if is_last or (cfg.eval_every and (r + 1) % cfg.eval_every == 0):
            evaluation = self.evaluate(self.evaluation_clients(r))
        t_eval = time.perf_counter() - t0
        eval_down, eval_up = self.transport.take_counts()
        # --- record
        round_row = {
            "round": r + 1,
            "selected": len(selected),
            "round/failed_clients": len(failed),
            "time/train": t_train,
            "time/aggregate": t_agg,
            "time/eval": t_eval,
            "time/round": time.perf_counter() - t_round,
            "throughput/samples_per_s": samples / t_train if t_train else 0.0,
            "comm/bytes_down": bytes_down,
            "comm/bytes_up": bytes_up,
            "comm/eval_bytes_down": eval_down,
            "comm/eval_bytes_up": eval_up,
            **self.transport.take_round_metrics(),  # e.g. per-rank throughput of a distributed transport
        }
        if cfg.eval_clients is not None:  # only with sampling on: rounds.csv is unchanged without it
            round_row["round/evaluated_clients"] = len(self.evaluated_clients) if evaluation else 0
        round_row.update(records.evaluation_means(evaluation))
        rows = records.client_rows(
            r + 1, list(self.data.client_ids), self._expand(selected), self._expand(failed), trained, evaluation
        )
        self.run_dir.add_rows(rows, round_row)
        per_client = records.per_client_keys(len(self.data.client_ids))  # else one table per round, not N keys
        self.tracker.log_round(
            r + 1,
            records.logged_metrics(round_row, trained, evaluation, per_client=per_client),
            clients=None if per_client else records.client_table(trained, evaluation),
        )
        recorded = set(round_row)
        for cb in self.callbacks:
            cb.on_round_end(self, r, round_row)
        added = {k: v for k, v in round_row.items() if k not in recorded}
        if added:  # a callback added round metrics (e.g. a clustering's Rand index): record them too
            self.run_dir.rewrite_rounds()
            self.tracker.log_round(r + 1, added)
        line = records.round_line(
            r + 1,
            cfg.rounds,
            trained,
            evaluation,
            round_row["time/round"],
            self.module.primary_metric,
            epsilon=records.round_epsilon(round_row),
        )
        self.reporter.round_end(line)
        return evaluation

    def _finish_stopped(self) -> None:
        """After a StopFederation: warn, evaluate the last models if their round was not, checkpoint them."""
        warnings.warn(self.stopped, stacklevel=3)
        self.reporter.note(self.stopped)
        if not self.last_evaluation:
            self.last_evaluation = self.evaluate()
        if self.config.checkpoint_every and self.round and self.round % self.config.checkpoint_every:
            self.save_checkpoint()  # the last round was not checkpointed yet

    def _expand(self, client_ids: list[str]) -> set[str]:
        """Client ids, with the pooled pseudo-client standing for every client."""
        return set(self.data.client_ids) if POOLED in client_ids else set(client_ids)

    # ------------------------------------------------------------------ messages
    def fit_task(self, r: int, group: ModelGroup, client_id: str) -> Task:
        """The ``fit`` task of ``client_id`` in ``group`` for round ``r``, with the callbacks' payloads."""
        cfg = self.config
        subset = group.subsets.get(client_id) if group.subsets is not None else None
        task = Task(
            protocol.FIT,
            r,
            client_id,
            group.name,
            state=group.state,
            epochs=cfg.local_epochs,
            steps=cfg.local_steps,
            subset=subset,
        )
        for cb in self.callbacks:
            cb.configure_task(self, task)
        return task

    def query(
        self,
        callback: FederatedCallback,
        name: str,
        client_ids: list[str],
        payloads: dict[str, Any] | Any = None,
        group: str = "",
        state: StateDict | None = None,
        per_client: bool = False,
    ) -> dict[str, Any]:
        """Ask each client in ``client_ids`` the callback's named query; returns ``{client: answer}`` in that order.

        Args:
            callback: The asking callback (its client half answers).
            name: The query's name.
            client_ids: Who is asked.
            payloads: The payload for every client, or (``per_client``) a dict of payloads by client.
            group: The group the query is about.
            state: A model state to send along (e.g. a group's global state).
            per_client: ``payloads`` is keyed by client id.
        """  # fmt: skip
        tasks = [
            Task(
                protocol.QUERY, self.round, cid, group, state=state, query=f"{callback.state_key}/{name}",
                payloads={callback.state_key: payloads.get(cid) if per_client else payloads},
            )
            for cid in client_ids
        ]  # fmt: skip
        return {t.client_id: callback.get_payload(reply) for t, reply in zip(tasks, self.transport.stream(tasks))}

    # ------------------------------------------------------------------ phases
    def select(self, r: int) -> list[str]:
        """Clients that train in round ``r`` (all of them in local and centralised mode)."""
        if self.config.mode == "centralized":
            return [POOLED]
        return training_clients(list(self.data.client_ids), r, self.seed, self.config)

    def num_samples(self, client_id: str, group: ModelGroup | None = None) -> int:
        """Training samples of a client (all clients' for the pooled pseudo-client; n_{i,m} in a sample-level group).

        The server knows these counts (as every FL server knows its clients' sizes); it never sees the samples.
        """
        if group is not None and group.subsets is not None and client_id in group.subsets:
            return len(group.subsets[client_id])
        if client_id == POOLED:
            return sum(self.data.num_train_samples(c) for c in self.data.client_ids)
        return self.data.num_train_samples(client_id)

    def aggregate(self, group: ModelGroup, mean: RunningWeightedMean) -> None:
        """Server step of one group: the weighted mean of the uploads, then the callbacks' server logic."""
        # Clients dropped out (or a callback re-weighted): renormalise, integer buffers included.
        averaged = mean.result(normalize=abs(mean.total_weight - 1.0) > 1e-9)
        for cb in self.callbacks:  # what the uploads mean (secure aggregation unmasks), before any server step
            averaged = cb.on_mean(self, group, group.state, averaged)
        for cb in self.callbacks:
            averaged = cb.on_aggregate(self, group, group.state, averaged)
        group.state = averaged

    def pass_on(self, r: int) -> None:
        """Peer-to-peer exchange: a fresh random cycle; every node passes its model to its successor via the relay.

        The server is the relay (engines have no node-to-node links): it takes each node's model and puts it on
        the successor. Callbacks relay what they pass on in ``on_pass_on`` (e.g. replay buffers); when a
        callback's ``moves_models()`` is False (FedER-A), models stay where they are.
        """
        move = all(cb.moves_models() for cb in self.callbacks)
        for group in self.groups:
            successor = random_cycle(group.members, r, self.seed)
            for cb in self.callbacks:
                cb.on_pass_on(self, r, successor)
            if move:
                take = [Task(protocol.TAKE_PRIVATE, r, c, group.name) for c in group.members]
                held = {t.client_id: reply.state for t, reply in zip(take, self.transport.stream(take))}
                put = [
                    Task(protocol.PUT_PRIVATE, r, successor[c], group.name, state=state)
                    for c, state in held.items()
                    if state is not None
                ]
                list(self.transport.stream(put))

    def split_group(self, group: ModelGroup, parts: list[list[str]]) -> list[ModelGroup]:
        """Replace ``group`` by one group per part of its clients (:func:`~fl_lightning.groups.split_by_clients`).

        The clients' private and optimiser states follow them into their new group.
        """
        return self._replace(group, split_by_clients(group, parts))

    def split_samples(self, group: ModelGroup, assignments: dict[str, torch.Tensor], n_parts: int) -> list[ModelGroup]:
        """Replace ``group`` by sample-level groups (:func:`~fl_lightning.groups.split_by_samples`).

        A client belongs to every part it has samples of, with weight n_{i,m}; its private and optimiser states
        are copied into each of them.
        """
        return self._replace(group, split_by_samples(group, assignments, n_parts, lambda c: self.num_samples(c, group)))

    def _replace(self, group: ModelGroup, children: list[ModelGroup]) -> list[ModelGroup]:
        """Swap ``group`` for ``children``; each member's runtime moves (or copies) its states there (``regroup``)."""
        targets: dict[str, list[str]] = {}
        for child in children:
            for cid in child.members:
                targets.setdefault(cid, []).append(child.name)
        options = [{"from": group.name, "to": names} for names in targets.values()]
        tasks = [Task(protocol.REGROUP, self.round, c, group.name, options=o) for c, o in zip(targets, options)]
        list(self.transport.stream(tasks))
        at = self.groups.index(group)
        self.groups[at : at + 1] = children
        return children

    def group_of(self, client_id: str) -> ModelGroup:
        """The group whose global model serves ``client_id`` at evaluation (the first, if it is in several)."""
        for group in self.groups:
            if client_id in group.members or POOLED in group.members:
                return group
        raise KeyError(f"client {client_id!r} belongs to no model group")

    def _serving_groups(self) -> dict[str, ModelGroup]:
        """:meth:`group_of` for every client at once (one pass over the groups instead of one per client)."""
        out: dict[str, ModelGroup] = {}
        for group in self.groups:
            for cid in self.data.client_ids if POOLED in group.members else group.members:
                out.setdefault(cid, group)
        return out

    def evaluation_clients(self, r: int) -> list[str]:
        """Clients evaluated in round ``r`` (0-based): all, or with ``eval_clients`` a seeded sample except last."""
        return evaluated_clients(list(self.data.client_ids), r, self.seed, self.config)

    def evaluate(self, client_ids: list[str] | None = None) -> dict[str, Any]:
        """Evaluate on every client's test set (not only the trained ones), one ``evaluate`` task per client.

        ``global``: the client's group model. ``personal``: the group model with the client's private
        state (identical to ``global`` when nothing is private, as in FedAvg, and then not recomputed).
        ``pooled``: the global model on all clients' test sets together, from what each client returns
        with its evaluation (the module's ``evaluation_parts``: test predictions for classification, additive
        counts for segmentation) — no second pass over the data. Peer-to-peer runs have no global model;
        there every node's model is evaluated on every node's test set (``node_matrix[holder][test node]``,
        summarised over all pairs as ``cross``).

        Args:
            client_ids: Evaluate only these clients (``federation.eval_clients``' sample, in the data's order);
                default all. Per-client results, their summaries and the pooled metrics are then over them only.
                :attr:`evaluated_clients` holds the list during the evaluation (callbacks' ``extra_evaluation``
                may restrict themselves to it).
        """
        self.evaluated_clients = list(self.data.client_ids) if client_ids is None else list(client_ids)
        if self.config.topology == "peer_to_peer":
            return evaluate_nodes(self.transport, self.groups[0], self.evaluated_clients, self.round)
        per_model: dict[str, dict[str, dict[str, float]]] = {"global": {}, "personal": {}}
        pooled = (
            self.has_global_model
            and len(self.groups) == 1
            and hasattr(self.module, "evaluation_parts")
            # predictions leave a client only in a simulation; additive counts (segmentation) may always
            and (self.transport.simulation or not getattr(self.module, "pooled_parts_are_predictions", True))
        )
        parts = []
        options = {"global": self.has_global_model, "outputs": pooled}
        serving = self._serving_groups()
        tasks = [
            Task(protocol.EVALUATE, self.round, cid, group.name, state=group.state, options=options)
            for cid in self.evaluated_clients
            for group in [serving.get(cid) or self.group_of(cid)]  # group_of raises for a client of no group
        ]
        for cid, reply in zip(self.evaluated_clients, self.transport.stream(tasks)):
            for model in ("global", "personal"):
                if model in reply.metrics:
                    per_model[model][cid] = reply.metrics[model]
            if pooled and reply.payloads.get("outputs"):
                parts.append(reply.payloads["outputs"])
        for cb in self.callbacks:  # e.g. cluster models with each test image routed to one of them
            for name, per_client in cb.extra_evaluation(self).items():
                per_model[name] = per_client
        out: dict[str, Any] = {
            "clients": per_model,
            "summary": {m: summarise(v) for m, v in per_model.items() if v},
        }
        if pooled and parts:
            out["pooled"] = self.module.metrics_from_parts(self.module.merge_parts(parts))
        return out

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

    def save_checkpoint(self) -> Path:
        """Write the round checkpoint atomically (the clients' states only where changed), prune old ones; its path."""
        path = checkpoint_path(self.run_dir.path, self.round)
        self.run_dir.sync()  # the rows the checkpoint counts are on disk before it is
        write_round_checkpoint(path, self.state_dict(), self.client_store, self.config.keep_checkpoints)
        return path
