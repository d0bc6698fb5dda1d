"""What a server is and does for the methods: its groups, tasks, queries, splits and evaluation (the ServerView).

:class:`Server` implements :class:`~fl_lightning.callback.ServerView`, the part of the server a callback's server
half may use; :class:`~fl_lightning.server.federation.Federation` adds the run around it (rounds, records,
checkpoints). It talks to the clients only through tasks sent by its transport.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch

from datamodules.base import FederatedDataModule
from fl_lightning.callback import FederatedCallback, ModelGroup, check_composition, check_cyclic
from fl_lightning.clients.base import ClientModule
from fl_lightning.config import FederationConfig
from fl_lightning.ops import RunningWeightedMean
from fl_lightning.ops.state import StateDict
from fl_lightning.server.directory import ClientDirectory
from fl_lightning.server.evaluation import evaluate
from fl_lightning.server.groups import regroup, split_by_clients, split_by_samples
from fl_lightning.server.selection import evaluated_clients, training_clients
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import POOLED, Task
from fl_lightning.wire.transport import Transport


class Server:
    """The server's state and its services to the methods; every client is reached through ``transport``.

    Args:
        config: Round settings (the ``federation:`` config section).
        module: The client module template (the initial global state; in process, also the runtime's module).
        datamodule: The clients' data. The server reads only its metadata (client ids, sample counts, the
            partition for ``partition.png``); training and evaluation happen in the runtime. A
            :class:`~fl_lightning.server.directory.ClientDirectory` where the server holds no data.
        trainer: The Trainer; its ``FederatedCallback`` callbacks define the method (their server halves run here).
        transport: What carries the tasks to the clients' runtimes.
        seed: Seed of client sampling and peer-to-peer order (the run's ``seed_everything``).

    Raises:
        ValueError: For callbacks in a reference mode, a method configured twice, or two server steps.
    """

    def __init__(
        self,
        config: FederationConfig,
        module: ClientModule,
        datamodule: FederatedDataModule | ClientDirectory,
        trainer: L.Trainer,
        transport: Transport,
        seed: int = 0,
    ) -> None:
        self.config, self.module, self.data, self.trainer, self.seed = config, module, datamodule, trainer, seed
        self.transport = transport
        self.callbacks = [cb for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
        self._check_mode()
        self._check_callbacks()
        self.groups: list[ModelGroup] = []
        self.round = 0
        self.run_dir: Any = None  # the run directory, once the run opened it
        self.evaluated_clients: list[str] = []  # the clients of the latest evaluation
        self.eval_split = "test"  # the split of the latest evaluation ("val" or "test")

    def _check_mode(self) -> None:
        cfg = self.config
        # statistics call no callback, so a method's config works as it is
        if cfg.mode not in ("federated", "stats") and self.callbacks:
            names = [type(cb).__name__ for cb in self.callbacks]
            what = "trains nothing" if cfg.mode == "evaluate" else "is a reference mode without communication"
            raise ValueError(
                f"federation.mode={cfg.mode} {what}; remove the federated callbacks {names} from trainer.callbacks"
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
        if self.config.topology == "cyclic":
            check_cyclic(self.callbacks)

    @property
    def device(self) -> torch.device:
        """Device of the server's Trainer."""
        return self.trainer.strategy.root_device

    @property
    def run_path(self) -> Path | None:
        """The run directory (``None`` before :meth:`run` opened it)."""
        return None if self.run_dir is None else self.run_dir.path

    @property
    def has_global_model(self) -> bool:
        """Whether a global model exists (not in local-only or peer-to-peer runs; a cycle's is the last client's)."""
        return self.config.mode != "local" and self.config.topology != "peer_to_peer"

    def uploaded_keys(self, group: ModelGroup) -> set[str]:
        """The state entries an honest client's fit reply in ``group`` carries (each callback may take some out)."""
        keys = set(group.state)
        for cb in self.callbacks:
            keys = cb.uploaded_keys(self.module, keys)
        return keys

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

    def split_group(self, group: ModelGroup, parts: list[list[str]]) -> list[ModelGroup]:
        """Replace ``group`` by one group per part of its clients (:func:`~.groups.split_by_clients`).

        The clients' private and optimiser states follow them into their new group.
        """
        return regroup(self, group, split_by_clients(group, parts))

    def split_samples(self, group: ModelGroup, assignments: dict[str, torch.Tensor], n_parts: int) -> list[ModelGroup]:
        """Replace ``group`` by sample-level groups (:func:`~fl_lightning.server.groups.split_by_samples`).

        A client belongs to every part it has samples of, with weight n_{i,m}; its private and optimiser states
        are copied into each of them.
        """
        return regroup(self, group, split_by_samples(group, assignments, n_parts, lambda c: self.num_samples(c, group)))

    def group_of(self, client_id: str) -> ModelGroup:
        """The group whose global model serves ``client_id`` at evaluation (the first, if it is in several)."""
        for group in self.groups:
            if client_id in group.members or POOLED in group.members:
                return group
        raise KeyError(f"client {client_id!r} belongs to no model group")

    def evaluation_clients(self, r: int) -> list[str]:
        """Clients evaluated in round ``r`` (0-based): all, or with ``eval_clients`` a seeded sample except last."""
        return evaluated_clients(list(self.data.client_ids), r, self.seed, self.config)

    @property
    def has_validation(self) -> bool:
        """Whether the clients have validation sets (``data.init_args.val_fraction`` > 0 or an official split)."""
        return bool(getattr(self.data, "has_validation", False))

    @property
    def round_split(self) -> str:
        """The split evaluation rounds score: ``val`` when the clients have one (test is then read at the end)."""
        return "val" if self.has_validation else "test"

    def evaluate(self, client_ids: list[str] | None = None, split: str | None = None) -> dict[str, Any]:
        """Evaluate every client in ``client_ids`` (default all) on ``split`` (:func:`~.evaluation.evaluate`).

        ``split`` defaults to :attr:`round_split`. :attr:`evaluated_clients` and :attr:`eval_split` hold the clients
        and the split during the evaluation (callbacks' ``extra_evaluation`` restrict themselves to them).
        """
        self.evaluated_clients = list(self.data.client_ids) if client_ids is None else list(client_ids)
        self.eval_split = self.round_split if split is None else split
        return evaluate(self, self.evaluated_clients, self.eval_split)

    def _expand(self, client_ids: list[str]) -> set[str]:
        """Client ids, with the pooled pseudo-client standing for every client."""
        return set(self.data.client_ids) if POOLED in client_ids else set(client_ids)
