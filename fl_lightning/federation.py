"""The round manager: one readable loop over rounds, clients and model groups."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import lightning as L
import torch

from callbacks.base import FederatedCallback
from datamodules.base import FederatedDataModule
from fl_lightning.clients.base import ClientModule
from fl_lightning.config import FederationConfig
from fl_lightning.evaluation import summarise
from fl_lightning.local_fit import LocalFitter
from fl_lightning.ops import RunningWeightedMean, aggregation_weights, clone_state, select_keys
from fl_lightning.ops.state import StateDict
from fl_lightning.report import RoundReporter
from fl_lightning.run_dir import RunDirectory
from fl_lightning.selection import num_selected, random_cycle, select_clients
from fl_lightning.state import ClientUpdate, ModelGroup

POOLED = "__pooled__"  # the single pseudo-client of centralised training


class Federation:
    """Trains a client module over the clients of a federated datamodule, one shared Trainer for all.

    Args:
        config: Round settings (the ``federation:`` config section).
        module: The client module; ONE instance is reused for every client (weights are loaded into it).
        datamodule: Per-client data.
        trainer: The shared Trainer; its ``FederatedCallback`` callbacks define the method.
        seed: Seed of client sampling and peer-to-peer order (the run's ``seed_everything``).
        config_text: Resolved config to save in the run directory.
        reporter: Terminal output (default: Rich, enabled by ``config.progress``).

    """

    def __init__(
        self,
        config: FederationConfig,
        module: ClientModule,
        datamodule: FederatedDataModule,
        trainer: L.Trainer,
        seed: int = 0,
        config_text: str | None = None,
        reporter: RoundReporter | None = None,
    ) -> None:
        self.config, self.module, self.data, self.trainer, self.seed = config, module, datamodule, trainer, seed
        self.config_text = config_text
        self.reporter = reporter or RoundReporter(enabled=config.progress)
        self.callbacks = [cb for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
        self._check_mode()
        self.fitter = LocalFitter(trainer)
        self.groups: list[ModelGroup] = []
        self.private: dict[tuple[str, str], StateDict] = {}  # (group, client) -> state that never leaves it
        self.optimizer_states: dict[tuple[str, str], dict[str, Any]] = {}
        self.private_keys: set[str] = set()
        self.round = 0
        self.run_dir: RunDirectory | None = None

    # ------------------------------------------------------------------ set-up
    def _check_mode(self) -> None:
        cfg = self.config
        if cfg.mode != "federated" and self.callbacks:
            names = [type(cb).__name__ for cb in self.callbacks]
            raise ValueError(
                f"federation.mode={cfg.mode} is a reference mode without communication; "
                f"remove the federated callbacks {names} from trainer.callbacks"
            )

    @property
    def device(self) -> torch.device:
        """Device of the shared Trainer (where evaluation runs)."""
        return self.trainer.strategy.root_device

    @property
    def has_global_model(self) -> bool:
        """Whether a server-side global model exists (not in local-only or peer-to-peer runs)."""
        return self.config.mode != "local" and self.config.topology == "star"

    def setup(self) -> None:
        """Create the model group(s) from the module's initial weights and decide what stays private."""
        cfg = self.config
        if not self.data.client_ids:
            raise ValueError("the datamodule has no clients")
        init = clone_state(self.module.state_dict())
        members = [POOLED] if cfg.mode == "centralized" else list(self.data.client_ids)
        self.groups = [ModelGroup("global", init, members)]
        if cfg.mode == "local" or cfg.topology == "peer_to_peer":
            self.private_keys = set(init)  # every node holds a whole model of its own
        else:
            self.private_keys = set().union(*(cb.private_keys(self.module) for cb in self.callbacks))
        unknown = self.private_keys - set(init)
        if unknown:
            raise KeyError(f"callbacks declared private keys the model does not have: {sorted(unknown)[:5]}")
        self.keep_optimizer_state = cfg.keep_optimizer_state or cfg.mode in ("local", "centralized")

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        """Run all rounds and the final evaluation.

        Returns:
            The summary that is also written to ``summary.json``.

        """
        self.setup()
        cfg = self.config
        self.run_dir = RunDirectory(cfg.output_dir, cfg.run_name, suffix=cfg.mode)
        if self.config_text is not None:
            self.run_dir.write_config(self.config_text)
        for cb in self.callbacks:
            cb.on_federation_start(self)
        self.reporter.start(cfg.rounds, str(self.run_dir.path), first_round=self.round)
        evaluation: dict[str, Any] = {}
        for r in range(self.round, cfg.rounds):
            evaluation = self.run_round(r)
            self.round = r + 1
        summary = self.summary(evaluation)
        self.run_dir.write_summary(summary)
        self.reporter.finish(summary, str(self.run_dir.path))
        return summary

    def run_round(self, r: int) -> dict[str, Any]:
        """One round: select → train each client → aggregate each group → evaluate → record."""
        cfg = self.config
        t_round = time.perf_counter()
        # --- select
        selected = self.select(r)
        for cb in self.callbacks:
            cb.on_round_start(self, r, selected)
        self.reporter.round_start(sum(len([c for c in selected if c in g.members]) for g in self.groups))
        # --- local training and streaming aggregation, per group
        client_rows: dict[str, dict[str, Any]] = {}
        failed: list[str] = []
        t_train = t_agg = 0.0
        samples = 0
        for group in self.groups:
            members = [c for c in selected if c in group.members]
            weights = aggregation_weights([self.num_samples(c) for c in members], cfg.aggregation)
            mean = RunningWeightedMean()
            for cid, weight in zip(members, weights):
                t0 = time.perf_counter()
                update = self.train_client(group, cid, weight)
                t_train += time.perf_counter() - t0
                self.reporter.client_done()
                if update is None:
                    failed.append(cid)
                    continue
                samples += update.num_steps * self.data.batch_size
                client_rows[cid] = {
                    "train_samples": update.num_samples,
                    "train_steps": update.num_steps,
                    **update.metrics,
                }
                t0 = time.perf_counter()
                mean.add(update.state, update.weight)
                t_agg += time.perf_counter() - t0
            if not mean.count:
                raise RuntimeError(f"round {r}: every selected client of group {group.name!r} failed: {members}")
            t0 = time.perf_counter()
            if self.has_global_model:
                self.aggregate(group, mean)
            t_agg += time.perf_counter() - t0
        if cfg.topology == "peer_to_peer":
            self.pass_on(r)
        # --- evaluate
        t0 = time.perf_counter()
        is_last = r + 1 == cfg.rounds
        evaluation = self.evaluate() if is_last or (cfg.eval_every and (r + 1) % cfg.eval_every == 0) else {}
        t_eval = time.perf_counter() - t0
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
        }
        for model, stats in evaluation.get("summary", {}).items():
            round_row.update({f"eval/{model}/{m}": s["mean"] for m, s in stats.items()})
        self.run_dir.add_rows(self._client_rows(r, selected, failed, client_rows, evaluation), round_row)
        for cb in self.callbacks:
            cb.on_round_end(self, r, round_row)
        self.reporter.round_end(_round_line(r, cfg.rounds, client_rows, evaluation, round_row["time/round"]))
        return evaluation

    # ------------------------------------------------------------------ phases
    def select(self, r: int) -> list[str]:
        """Clients that train in round ``r`` (all of them in local and centralised mode)."""
        cfg = self.config
        if cfg.mode == "centralized":
            return [POOLED]
        ids = list(self.data.client_ids)
        if cfg.mode == "local" or cfg.topology == "peer_to_peer":
            return ids
        return select_clients(ids, r, self.seed, num_selected(len(ids), cfg.client_fraction, cfg.clients_per_round))

    def num_samples(self, client_id: str) -> int:
        """Training samples of a client (of all clients for the pooled pseudo-client)."""
        if client_id == POOLED:
            return sum(self.data.num_train_samples(c) for c in self.data.client_ids)
        return self.data.num_train_samples(client_id)

    def train_client(self, group: ModelGroup, client_id: str, weight: float) -> ClientUpdate | None:
        """Load the client's weights, fit locally, and package the upload; ``None`` if the client failed."""
        cfg, module, key = self.config, self.module, (group.name, client_id)
        module.load_state_dict({**group.state, **self.private.get(key, {})})
        for cb in self.callbacks:
            cb.on_client_start(self, client_id, module)
        steps = cfg.local_steps
        if client_id == POOLED:
            loader = self.data.pooled_train_loader(steps=steps)
        else:
            loader = self.data.client_train_loader(client_id, steps=steps)
        try:
            num_steps, opt_state = self.fitter.fit(
                module,
                loader,
                1 if steps else cfg.local_epochs,
                client_id,
                optimizer_state=self.optimizer_states.get(key),
                keep_optimizer_state=self.keep_optimizer_state,
            )
        except Exception as err:  # noqa: BLE001 - one client's failure must not end the run
            warnings.warn(f"client {client_id!r} failed and is left out of this round: {err!r}", stacklevel=2)
            return None
        report = module.fit_report()
        state = clone_state(module.state_dict())
        if not math.isfinite(report["train_loss"]) or not _all_finite(state):
            warnings.warn(
                f"client {client_id!r} produced a non-finite loss or weights; left out of this round", stacklevel=2
            )
            return None
        if self.private_keys:
            self.private[key] = select_keys(state, self.private_keys)
        if opt_state is not None:
            self.optimizer_states[key] = opt_state
        update = ClientUpdate(
            client_id=client_id,
            group=group.name,
            state=state,
            num_samples=self.num_samples(client_id),
            weight=weight,
            num_steps=num_steps,
            metrics={"train_loss": report["train_loss"]},
        )
        for cb in self.callbacks:
            cb.on_client_end(self, client_id, module, update)
        return update

    def aggregate(self, group: ModelGroup, mean: RunningWeightedMean) -> None:
        """Server step of one group: the weighted mean of the uploads, then the callbacks' server logic."""
        # Clients dropped out (or a callback re-weighted): renormalise, integer buffers included.
        averaged = mean.result(normalize=abs(mean.total_weight - 1.0) > 1e-9)
        for cb in self.callbacks:
            averaged = cb.on_aggregate(self, group, group.state, averaged)
        group.state = averaged

    def pass_on(self, r: int) -> None:
        """Peer-to-peer exchange: every node's model goes to its successor in a fresh random cycle."""
        for group in self.groups:
            successor = random_cycle(group.members, r, self.seed)
            held = {c: self.private[(group.name, c)] for c in group.members if (group.name, c) in self.private}
            for c, state in held.items():
                self.private[(group.name, successor[c])] = state

    def group_of(self, client_id: str) -> ModelGroup:
        """The group whose global model serves ``client_id`` at evaluation."""
        for group in self.groups:
            if client_id in group.members or POOLED in group.members:
                return group
        raise KeyError(f"client {client_id!r} belongs to no model group")

    def evaluate(self) -> dict[str, Any]:
        """Global and personalised models on every client's test set, and the global model on the pooled test set."""
        per_model: dict[str, dict[str, dict[str, float]]] = {"global": {}, "personal": {}}
        module, device = self.module, self.device
        module.to(device)
        for cid in self.data.client_ids:
            group = self.group_of(cid)
            loader = self.data.client_test_loader(cid)
            if self.has_global_model:
                module.load_state_dict(group.state)
                per_model["global"][cid] = module.evaluate(loader, device)
            if self.private_keys:
                module.load_state_dict({**group.state, **self.private.get((group.name, cid), {})})
                per_model["personal"][cid] = module.evaluate(loader, device)
        out: dict[str, Any] = {
            "clients": per_model,
            "summary": {m: summarise(v) for m, v in per_model.items() if v},
        }
        if self.has_global_model and len(self.groups) == 1:
            module.load_state_dict(self.groups[0].state)
            out["pooled"] = module.evaluate(self.data.pooled_test_loader(), device)
        return out

    def summary(self, evaluation: dict[str, Any]) -> dict[str, Any]:
        """The final evaluation table (what ``summary.json`` holds)."""
        clients = {
            cid: {
                "test_samples": len(self.data.client_test_loader(cid).dataset),
                **{m: evaluation["clients"][m][cid] for m in ("global", "personal") if cid in evaluation["clients"][m]},
            }
            for cid in self.data.client_ids
        }
        out = {
            "run_dir": str(self.run_dir.path),
            "mode": self.config.mode,
            "topology": self.config.topology,
            "rounds": self.round,
            "methods": [type(cb).__name__ for cb in self.callbacks] or ["FedAvg"],
            "clients": clients,
            "summary": evaluation["summary"],
        }
        if "pooled" in evaluation:
            out["pooled"] = evaluation["pooled"]
            out["pooled_test_samples"] = len(self.data.pooled_test_loader().dataset)
        return out

    def _client_rows(
        self,
        r: int,
        selected: list[str],
        failed: list[str],
        trained: dict[str, dict[str, Any]],
        evaluation: dict[str, Any],
    ) -> list[dict[str, Any]]:
        rows = []
        for cid in self.data.client_ids:
            row: dict[str, Any] = {
                "round": r + 1,
                "client": cid,
                "selected": int(cid in selected or POOLED in selected),
                "failed": int(cid in failed),
            }
            row.update(trained.get(cid, {}))
            for model, per_client in evaluation.get("clients", {}).items():
                row.update({f"{model}/{k}": v for k, v in per_client.get(cid, {}).items()})
            rows.append(row)
        return rows


def _all_finite(state: StateDict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


def _round_line(
    r: int, rounds: int, trained: dict[str, dict[str, Any]], evaluation: dict[str, Any], seconds: float
) -> str:
    losses = [m["train_loss"] for m in trained.values()]
    parts = [f"round {r + 1}/{rounds}", f"train loss {sum(losses) / max(len(losses), 1):.4f}"]
    for model, stats in evaluation.get("summary", {}).items():
        if "acc" in stats:
            acc = stats["acc"]
            parts.append(f"{model} acc {acc['mean']:.4f} ± {acc['std']:.4f} (worst {acc['worst']:.4f})")
    parts.append(f"{seconds:.1f}s")
    return " │ ".join(parts)
