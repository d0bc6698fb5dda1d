"""The client side of the boundary: a runtime hosts clients and answers the server's tasks.

A :class:`ClientRuntime` holds what never leaves the clients it hosts: their data, their private state
(norm layers under FedBN, SCAFFOLD's c_i, MOON's previous model, kept optimiser state, …), the shared
Trainer and client module, and the client halves of the callbacks. It knows nothing of the Federation:
everything it learns arrives in a :class:`~fl_lightning.wire.protocol.Task`, everything it tells goes back in a
:class:`~fl_lightning.wire.protocol.Reply`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch

from datamodules.base import FederatedDataModule
from datamodules.sampler import SeededEpochSampler, stable_seed
from fl_lightning.callback import ClientContext, FederatedCallback
from fl_lightning.config import FederationConfig
from fl_lightning.errors import PreconditionError
from fl_lightning.ops import clone_state, select_keys
from fl_lightning.ops.rng import seeded_rng
from fl_lightning.ops.state import StateDict, all_finite
from fl_lightning.runtime import site_stats
from fl_lightning.runtime.local_fit import LocalFitter
from fl_lightning.runtime.secure_stats import SecureStatsSite
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import POOLED, Reply, Task


@dataclass
class ClientFit:
    """One client's fit: its task, its callbacks' bound contexts, its loader and budget."""

    task: Task
    contexts: list[tuple[FederatedCallback, ClientContext]]
    loader: Any
    epochs: int
    optimizer_state: dict[str, Any] | None


def local_passes(task: Task) -> int:
    """The passes over its loader a fit task asks for: its epochs, or one pass of ``task.steps`` batches."""
    return 1 if task.steps else task.epochs


class ClientRuntime:
    """Hosts clients and answers tasks: ``fit``, ``evaluate``, callback queries and state moves.

    Args:
        module: The client module (one instance for every hosted client).
        data: The hosted clients' data.
        trainer: The Trainer that trains every hosted client; its ``FederatedCallback`` callbacks are the
            client halves.
        config: The run's ``federation:`` settings (budget defaults, mode, topology).
        seed: The run's seed.
        prepared: ``module`` already carries the callbacks' layers (it is shared with an in-process server).
        note: Where to print progress notes (e.g. a GAN phase starting).
        client_ids: The clients this runtime hosts (default: every client of ``data``, and the pooled
            pseudo-client); a shard of them when the clients are spread over processes.

    """

    def __init__(
        self,
        module: L.LightningModule,
        data: FederatedDataModule,
        trainer: L.Trainer,
        config: FederationConfig,
        seed: int = 0,
        prepared: bool = False,
        note: Callable[[str], None] | None = None,
        client_ids: list[str] | None = None,
    ) -> None:
        self.module, self.data, self.trainer, self.config, self.seed = module, data, trainer, config, seed
        self.client_ids = list(data.client_ids) + [POOLED] if client_ids is None else list(client_ids)
        self.callbacks = [cb for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
        self.fitter = LocalFitter(trainer)
        self.note = note or (lambda message: None)
        self._prepared = prepared
        self.workdir: Path | None = None
        self.private_keys: set[str] = set()
        # client -> group -> state; client -> group -> optimiser state; client -> callback key -> state
        self.private: dict[str, dict[str, StateDict]] = {}
        self.optimizer_states: dict[str, dict[str, dict[str, Any]]] = {}
        self.callback_states: dict[str, dict[str, dict[str, Any]]] = {}
        # client -> group -> a whole personal model (ClientContext.personal); client -> group -> round of its last fit
        self.personal: dict[str, dict[str, StateDict]] = {}
        self.fit_rounds: dict[str, dict[str, int]] = {}
        self.kept_round: dict[str, int] = {}  # client -> the round its KEPT states were copied in
        self.secure_stats = SecureStatsSite()  # secure statistics' ephemeral keys (memory only, never checkpointed)
        self.subset_samplers: dict[tuple[str, str], SeededEpochSampler] = {}  # (group, client)
        self._by_key = {cb.state_key: cb for cb in self.callbacks}
        # client -> tasks that may have changed its state: a checkpoint rewrites a client only when this moved
        self.generations: dict[str, int] = {}
        # (kind, client, group, query) -> how many such tasks ran in round _task_round (see task_seed)
        self._task_round = -1
        self._task_repeats: dict[tuple[str, str, str, str], int] = {}

    @property
    def device(self) -> torch.device:
        """Device of the Trainer (where the runtime trains and evaluates)."""
        return self.trainer.strategy.root_device

    # ------------------------------------------------------------------ set-up
    def prepare(self) -> None:
        """Add the callbacks' layers to the module (unless shared with a server that did) and find private keys.

        The hosted clients' samplers start at their first pass: a datamodule that served another run in this
        process (a notebook, a script running two methods) would otherwise carry its samplers' passes over, and two
        identical runs would draw different batches. A resume restores the checkpoint's passes afterwards.
        """
        self.data.load_sampler_state({key: 0 for key in self.data.sampler_state()})
        if not self._prepared:
            for cb in self.callbacks:
                cb.prepare_module(self.module, self.data)
            self._prepared = True
        cfg = self.config
        if cfg.mode == "local" or cfg.topology == "peer_to_peer":
            self.private_keys = set(self.module.state_dict())  # every node holds a whole model of its own
        else:
            self.private_keys = set().union(*(cb.private_keys(self.module) for cb in self.callbacks))
        self.keep_optimizer_state = cfg.keep_optimizer_state or cfg.mode in ("local", "centralized")

    def start(self, workdir: Path | None) -> None:
        """Start serving: ``workdir`` is this side's directory for large files (the run directory in simulation)."""
        self.workdir = workdir
        for cb in self.callbacks:
            cb.on_runtime_start(self)

    # ------------------------------------------------------------------ tasks
    def handle(self, task: Task) -> Reply:
        """Answer one task."""
        handlers = {
            protocol.FIT: self._fit,
            protocol.EVALUATE: self._evaluate,
            protocol.QUERY: self._query,
            protocol.STATS: self._stats,
            protocol.REGROUP: self._regroup,
            protocol.TAKE_PRIVATE: self._take_private,
            protocol.PUT_PRIVATE: self._put_private,
            protocol.KEEP: self._keep,
        }
        if task.kind not in handlers:
            raise ValueError(f"task of unknown kind {task.kind!r} for client {task.client_id!r}")
        if task.kind not in (protocol.EVALUATE, protocol.STATS):  # the kinds that change no state
            self.generations[task.client_id] = self.generations.get(task.client_id, 0) + 1
        with seeded_rng(self.task_seed(task)):
            return handlers[task.kind](task)

    def task_seed(self, task: Task) -> int:
        """The seed of the global generators while ``task`` runs: (run seed, task, client, round, group, repeat).

        A client's dropout masks and random transforms then depend on the client and the round alone, not on which
        process hosts it or which clients it followed there, so one process, any number of ranks, Flower sites and
        a resumed run all draw the same. ``repeat`` counts the same task of the client earlier in the round (a
        peer-to-peer client fits once per turn), so two fits never share their draws.
        """
        key = (task.kind, task.client_id, task.group, task.query)
        if self._task_round != task.round:
            self._task_round, self._task_repeats = task.round, {}
        repeat = self._task_repeats.get(key, 0)
        self._task_repeats[key] = repeat + 1
        return stable_seed(self.seed, "client-task", *key, task.round, repeat)

    def handle_bytes(self, data: bytes) -> bytes:
        """Answer an encoded task with an encoded reply (what a remote transport calls)."""
        task = protocol.decode_task(data)
        return protocol.encode(self.handle(task))

    def handle_many_bytes(self, messages: list[bytes]) -> Iterator[bytes]:
        """:meth:`handle_many` for encoded tasks: every task is decoded first, then the encoded replies in order."""
        tasks = [protocol.decode_task(data) for data in messages]
        return (protocol.encode(reply) for reply in self.handle_many(tasks))

    def context(self, cb: FederatedCallback, task: Task) -> ClientContext:
        """The client context of ``cb`` for ``task``."""
        cid = task.client_id
        state = self.callback_states.setdefault(cid, {}).setdefault(cb.state_key, {})
        return ClientContext(
            cid, task.round, task.group, cb.get_payload(task), state, task.state, task,
            module=self.module, data=self.data, device=self.device, config=self.config, seed=self.seed,
            private=self.private_state(cid, task.group), private_keys=self.private_keys,
            hosted_states=partial(self.hosted_states, cb.state_key), fit_alone=partial(self.fit_alone, cid),
            personal=self.personal.get(cid, {}).get(task.group),
        )  # fmt: skip

    def hosted_states(self, key: str) -> dict[str, dict[str, Any]]:
        """Callback ``key``'s per-client state of every hosted client that has one, ``{client: state}``."""
        return {cid: states[key] for cid, states in self.callback_states.items() if key in states}

    def fit_alone(self, client_id: str, loader: Any, epochs: int) -> int:
        """Fit the module for ``client_id`` on ``loader`` with a fresh optimiser, the federated callbacks detached.

        A plain local fit inside a task (e.g. fine-tuning the final model): the methods' callbacks must neither act
        on it (FedProx would pull towards the start weights, SCAFFOLD add last round's control variates) nor update
        their per-client state from it. Lightning's own callbacks and the fitter's probe stay; the Trainer's list is
        restored whatever happens.

        Returns:
            The optimiser steps taken.
        """
        trainer = self.trainer
        callbacks = trainer.callbacks
        trainer.callbacks = [cb for cb in callbacks if not isinstance(cb, FederatedCallback)]
        try:
            steps, _ = self.fitter.fit(self.module, loader, epochs, client_id)
        finally:
            trainer.callbacks = callbacks
        return steps

    def private_state(self, client_id: str, group: str) -> StateDict:
        """The client's private state in ``group`` (empty if it has none yet)."""
        return self.private.get(client_id, {}).get(group, {})

    def handle_many(self, tasks: list[Task]) -> Iterator[Reply]:
        """Answer tasks in order, one at a time (each fit task is one ``trainer.fit`` of its client)."""
        return (self.handle(task) for task in tasks)

    def _fit(self, task: Task) -> Reply:
        fit = self._begin_fit(task)
        try:
            num_steps, opt_state = self.fitter.fit(
                self.module,
                fit.loader,
                fit.epochs,
                task.client_id,
                optimizer_state=fit.optimizer_state,
                keep_optimizer_state=self.keep_optimizer_state,
            )
        except PreconditionError:
            raise  # a method that cannot work here fails the run, not one client
        except Exception as err:  # noqa: BLE001 - one client's failure must not end the run
            return self._failed_fit(fit, err)
        else:
            return self._finish_fit(fit, num_steps, opt_state)
        finally:
            self._unbind(fit)

    def _begin_fit(self, task: Task) -> ClientFit:
        """Start a client's fit: its weights, the callbacks bound to its contexts, ``on_client_start``, its loader."""
        cid, module = task.client_id, self.module
        module.load_state_dict({**task.state, **self.private_state(cid, task.group)})
        if hasattr(module, "lr_factor"):
            module.lr_factor = task.lr_factor
        contexts = [(cb, self.context(cb, task)) for cb in self.callbacks]
        fit = ClientFit(task, contexts, None, local_passes(task), None)
        for cb, ctx in contexts:
            cb.bind_client(ctx)
        try:
            for cb, ctx in contexts:
                cb.on_client_start(ctx, module)
            loader = self._train_loader(task)
            for cb, ctx in contexts:
                loader = cb.wrap_train_loader(ctx, loader)
        except BaseException:
            self._unbind(fit)
            raise
        fit.loader = loader
        fit.optimizer_state = self.optimizer_states.get(cid, {}).get(task.group)
        return fit

    @staticmethod
    def _unbind(fit: ClientFit) -> None:
        for cb, _ in fit.contexts:
            cb.bind_client(None)

    @staticmethod
    def _failed_fit(fit: ClientFit, err: Exception) -> Reply:
        return Reply(fit.task.client_id, fit.task.group, error=f"its local fit raised {err!r}")

    def _finish_fit(self, fit: ClientFit, num_steps: int, opt_state: dict[str, Any] | None) -> Reply:
        """End a client's fit that trained ``num_steps`` batches: its reply, ``on_client_end`` and ``on_upload``."""
        task, module = fit.task, self.module
        cid = task.client_id
        report = module.fit_report()
        state = clone_state(module.state_dict())
        if not math.isfinite(report["train_loss"]) or not all_finite(state):
            return Reply(cid, task.group, error="it produced a non-finite loss or weights")
        if self.private_keys:
            self.private.setdefault(cid, {})[task.group] = select_keys(state, self.private_keys)
        if opt_state is not None:
            self.optimizer_states.setdefault(cid, {})[task.group] = opt_state
        reply = Reply(
            cid,
            task.group,
            state=state,
            num_samples=self.num_samples(cid, task.subset),
            num_steps=num_steps,
            metrics={"train_loss": report["train_loss"]},
        )
        for cb, ctx in fit.contexts:
            cb.on_client_end(ctx, module, reply)
        self._keep_personal(fit)
        self.fit_rounds.setdefault(cid, {})[task.group] = task.round
        for cb, ctx in fit.contexts:  # after every on_client_end: e.g. secure aggregation masks the final update
            cb.on_upload(ctx, reply)
        return reply

    def _keep_personal(self, fit: ClientFit) -> None:
        """Store the personal model a callback set in its context (two callbacks setting one are refused)."""
        task = fit.task
        held = self.personal.get(task.client_id, {}).get(task.group)
        new = [(cb, ctx.personal) for cb, ctx in fit.contexts if ctx.personal is not None and ctx.personal is not held]
        if len(new) > 1:
            names = ", ".join(type(cb).__name__ for cb, _ in new)
            raise PreconditionError(f"{names} each train a personal model: a run can keep only one, remove all but one")
        if new:
            self.personal.setdefault(task.client_id, {})[task.group] = new[0][1]

    def num_samples(self, client_id: str, subset: torch.Tensor | None = None) -> int:
        """Training samples of a hosted client (of its subset in a sample-level group; all for the pooled one)."""
        if subset is not None:
            return len(subset)
        if client_id == POOLED:
            return sum(self.data.num_train_samples(c) for c in self.data.client_ids)
        return self.data.num_train_samples(client_id)

    def _train_loader(self, task: Task) -> Any:
        steps, cid = task.steps, task.client_id
        if cid == POOLED:
            return self.data.pooled_train_loader(steps=steps)
        if task.subset is not None:
            return self.data.client_subset_train_loader(cid, task.subset, self.subset_sampler(task), steps=steps)
        return self.data.client_train_loader(cid, steps=steps)

    def subset_sampler(self, task: Task) -> SeededEpochSampler:
        """The persistent sampler of a client's subset in a sample-level group (created on first use)."""
        key = (task.group, task.client_id)
        existing = self.subset_samplers.get(key)
        if not isinstance(existing, SeededEpochSampler):
            seed = stable_seed(self.data.seed, "subset", task.group, task.client_id)
            self.subset_samplers[key] = SeededEpochSampler(len(task.subset), seed)
            if existing is not None:  # restored from a checkpoint
                self.subset_samplers[key].epoch = existing.epoch
        return self.subset_samplers[key]

    def _evaluate(self, task: Task) -> Reply:
        """The group's model (``global``) and the client's own (``personal``) on the client's test or validation set.

        Options: ``split`` (``test``, the default, or ``val``), ``global`` (evaluate the received state), ``outputs``
        (also return what pooled metrics need: the module's ``evaluation_parts``, additive counts or, for
        classification, the predictions).
        """
        cid, module, device = task.client_id, self.module, self.device
        opts = task.options
        module.to(device)
        split = str(opts.get("split", "test"))
        loader = self.data.client_eval_loader(cid, split)
        metrics: dict[str, Any] = {}
        payloads: dict[str, Any] = {}
        if opts.get("global", True):
            module.load_state_dict(task.state)
            if opts.get("outputs") and hasattr(module, "evaluation_parts"):
                parts = module.evaluation_parts(loader, device)
                metrics["global"] = module.metrics_from_parts(parts) if parts else {}
                payloads["outputs"] = parts
            else:
                metrics["global"] = module.evaluate(loader, device)
        private = self.private_state(cid, task.group)
        personal = self.personal.get(cid, {}).get(task.group)
        if not opts.get("personal", True):
            pass
        elif personal is not None or private:
            module.load_state_dict(personal if personal is not None else {**task.state, **private})
            metrics["personal"] = module.evaluate(loader, device)
            age = self.rounds_old(cid, task)
            if age is not None:
                metrics[protocol.ROUNDS_OLD] = age
        elif "global" in metrics:
            metrics["personal"] = dict(metrics["global"])
        return Reply(cid, task.group, metrics=metrics, payloads=payloads)

    def rounds_old(self, client_id: str, task: Task) -> int | None:
        """How many rounds ago the client's personal model in the task's group was last trained (None: never).

        0 when it trained in the task's round. A kept (best round's) model's age counts from the round it was kept in.
        """
        fitted = self.fit_rounds.get(client_id, {}).get(task.group)
        if fitted is None:
            return None
        now = self.kept_round.get(client_id, task.round) if task.group.startswith(protocol.KEPT) else task.round
        return max(now - fitted, 0)

    def _stats(self, task: Task) -> Reply:
        """The client's released summaries of its data (:func:`~fl_lightning.runtime.site_stats.site_statistics`)."""
        rules = site_stats.strictest(task.options, self.config.stats_rules())  # the site's own floor holds
        try:
            if "phase" in task.options:  # a secure sum (fl_lightning.runtime.secure_stats)
                metrics = self.secure_stats.answer(self.data, task.client_id, task.options, rules)
                return Reply(task.client_id, task.group, metrics={**metrics, "rules": rules})
            if rules["secure"]:
                raise PreconditionError(
                    f"client {task.client_id!r}'s site releases its statistics only in a secure sum (its own "
                    "federation.stats_secure=true): run them with --federation.stats_secure=true"
                )
            released = site_stats.site_statistics(self.data, task.client_id, rules)
        except Exception as err:  # one site's bad data must not stop the others' statistics: it is reported failed
            return Reply(task.client_id, task.group, error=f"{type(err).__name__}: {err}")
        return Reply(task.client_id, task.group, metrics={"stats": released, "rules": rules})

    def _query(self, task: Task) -> Reply:
        key, _, name = task.query.rpartition("/")
        cb = self._by_key.get(key)
        if cb is None:
            raise KeyError(f"query {task.query!r} for client {task.client_id!r}: no callback {key!r} on this runtime")
        answer = cb.answer_query(self.context(cb, task), name, cb.get_payload(task))
        return Reply(task.client_id, task.group, payloads={key: answer})

    def _regroup(self, task: Task) -> Reply:
        """The client's private and optimiser states of group ``from`` go to each group in ``to``.

        With one target the state moves (a cluster split: CFL); with several each gets a copy (sample-level
        groups: the client trains in several of them).
        """
        cid, source, targets = task.client_id, task.options["from"], list(task.options["to"])
        for store in (self.private, self.optimizer_states, self.personal, self.fit_rounds):
            held = store.get(cid, {})
            if source in held:
                value = held.pop(source)
                for target in targets:
                    held[target] = copy.deepcopy(value) if len(targets) > 1 else value
        return Reply(cid, task.group)

    def _take_private(self, task: Task) -> Reply:
        """The client's private state in the task's group (removed from here with option ``remove``).

        With option ``own`` and a whole personal model (:attr:`ClientContext.personal`), that model instead: the
        client's own model for the cross-site evaluation.
        """
        if task.options.get("own"):
            personal = self.personal.get(task.client_id, {}).get(task.group)
            if personal is not None:
                return Reply(task.client_id, task.group, state=personal)
        held = self.private.get(task.client_id, {})
        state = held.pop(task.group, None) if task.options.get("remove") else held.get(task.group)
        return Reply(task.client_id, task.group, state=state)

    def _keep(self, task: Task) -> Reply:
        """Copy every private and personal state of the client (and its age) to ``KEPT + group`` (the best round's).

        The older copy is dropped.
        """
        cid = task.client_id
        for store, copy_of in ((self.private, clone_state), (self.personal, clone_state), (self.fit_rounds, int)):
            held = store.get(cid, {})
            for name in [n for n in held if n.startswith(protocol.KEPT)]:
                del held[name]
            for name in list(held):
                held[protocol.KEPT + name] = copy_of(held[name])
        self.kept_round[cid] = task.round
        return Reply(cid, task.group)

    def _put_private(self, task: Task) -> Reply:
        if task.state is None:
            self.private.get(task.client_id, {}).pop(task.group, None)
        else:
            self.private.setdefault(task.client_id, {})[task.group] = task.state
        return Reply(task.client_id, task.group)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every hosted client's state, keyed by client id first (so shards of clients can be merged)."""
        samplers: dict[str, dict[str, int]] = {}
        for (group, cid), sampler in self.subset_samplers.items():
            samplers.setdefault(cid, {})[group] = sampler.epoch
        return {
            "private": self.private,
            "optimizer_states": self.optimizer_states,
            "callback_states": self.callback_states,
            "subset_samplers": samplers,
            "callbacks": {cb.state_key: cb.client_state_dict() for cb in self.callbacks},
            "data": {c: epoch for c, epoch in self.data.sampler_state().items() if c in self.client_ids},
            "generations": dict(self.generations),
            "personal": self.personal,
            "fit_rounds": self.fit_rounds,
            "kept_round": self.kept_round,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the clients this runtime hosts)."""
        self.private = {c: dict(g) for c, g in state["private"].items()}
        self.optimizer_states = {c: dict(g) for c, g in state["optimizer_states"].items()}
        self.callback_states = {c: {k: dict(v) for k, v in s.items()} for c, s in state["callback_states"].items()}
        self.subset_samplers = {}
        for cid, groups in state["subset_samplers"].items():
            for group, epoch in groups.items():
                # the size is re-bound on first use: SeededEpochSampler only needs (n, seed, epoch)
                self.subset_samplers[(group, cid)] = _PendingSampler(int(epoch))
        for cb in self.callbacks:
            cb.load_client_state_dict(state["callbacks"].get(cb.state_key, {}))
        self.data.load_sampler_state(state["data"])
        self.generations = dict(state.get("generations", {}))
        self.personal = {c: dict(g) for c, g in state.get("personal", {}).items()}
        self.fit_rounds = {c: dict(g) for c, g in state.get("fit_rounds", {}).items()}
        self.kept_round = dict(state.get("kept_round", {}))


class _PendingSampler:
    """A restored subset sampler's epoch until the first task tells its subset size."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
