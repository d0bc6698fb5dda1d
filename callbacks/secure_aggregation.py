"""Secure aggregation: clients mask their model updates so that the server learns only the weighted sum."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from fl_lightning.errors import PreconditionError
from fl_lightning.ops import aggregation_weights, secagg

if TYPE_CHECKING:
    import lightning as L

    from fl_lightning.callback import ClientContext, ModelGroup, ServerView
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Reply, Task

# Methods checked to work on the aggregate alone (their server half never reads one client's update) and whose
# client half leaves the reply's state as the update to protect. Anything else is refused, with its reason.
COMPATIBLE = {"FedProx", "FedBN", "FedOpt", "DPFedAvg", "LRSchedule", "SecureAggregation"}
REFUSED_REASONS = {
    "Scaffold": "its server averages each client's control variate update c_i⁺ − c_i, sent in the clear",
    "FedNova": "its server normalises each client's update by that client's a_i",
    "FedDyn": "its server reads each client's update to keep h",
    "ClusteredFL": "it clusters clients by their individual updates",
    "AmplitudeNormalization": "its server reads each client's amplitude spectrum",
    "DomainIsolation": "its server reads per-client routing and features",
}


def masked_names(state: StateDict, private: set[str]) -> list[str]:
    """The entries an update masks: every floating entry that is shared (not private), in sorted key order.

    Sorted, not ``state_dict`` order, so server and client agree whatever order a transport gives the keys.
    """
    return sorted(k for k, v in state.items() if v.is_floating_point() and k not in private)


def flat_update(state: StateDict, received: StateDict, names: list[str]) -> torch.Tensor:
    """Δ = w_i − w over ``names``, flattened in that order (float64)."""
    return torch.cat(
        [(state[k].detach().double().cpu() - received[k].detach().double().cpu()).reshape(-1) for k in names]
    )


class SecureAggregation(FederatedCallback):
    """Pairwise-masked secure aggregation of whole model updates (Bonawitz et al. 2017, without dropout recovery).

    **Keys.** At federation start the server sends each client a ``public_key`` query; the client draws an X25519
    key pair from the OS's randomness (not the run seed), keeps the private key in its private state
    (``ctx.state``, hence in the runtime's checkpoints: a checkpoint holds every hosted client's secret key and
    must be kept as secret as the clients' data) and answers its public key. The server keeps the public keys
    and relays those of the round's selected clients in every fit task.

    **Client half** (``on_upload``, after every other callback's ``on_client_end``, so it masks what DP-FedAvg
    clipped and noised): u_i = q(p_i Δ_i) + Σ_j ±r_ij mod 2^64, with Δ_i = w_i − w over every shared floating
    entry (parameters and float buffers such as BatchNorm's running statistics; private keys such as FedBN's never
    leave), p_i the client's public aggregation weight (sent in the task; n_i/Σn or 1/m as
    ``federation.aggregation`` says), q the fixed point with ``bits`` fraction bits and r_ij the pair's mask: AES-CTR
    keyed by HKDF-SHA256(X25519(i, j), info = run, round, group, pair), fresh every round. The reply's state is left
    empty: the server receives u_i, the sample and step counts and the training loss, nothing else of the model.

    **Server half** (``on_mean``, before every ``on_aggregate``): w ← w + dequantise(Σ_i u_i mod 2^64) =
    w + Σ_i p_i Δ_i (the masks cancel), within m · 2^-(bits+1) per entry; FedOpt and DP-FedAvg then act on that mean.
    Integer entries (BatchNorm's ``num_batches_tracked``) are not aggregated: they keep the global value.

    **Dropout.** A selected client that fails leaves its pairs' masks uncancelled. The server then asks the
    clients that did answer (two at least) for a mask correction: new mask − old mask, the new masks drawn with fresh
    pair keys over them alone (session ``run|without:<dropped>``); added to the uploads it holds, their masks cancel
    and the round goes on with Σ p_i Δ_i / Σ p_i over them, the renormalised mean FedAvg takes without the dropped
    ones. A client answers a correction only for the round it last masked, over peers it masked with. With fewer
    than two survivors the round is refused and the run stops. Unlike SecAgg's double masking, this trusts the
    server to say truthfully who dropped: a server that drops a client whose upload it did receive learns that
    client's update as the difference of the two sums (use ``scheme="secaggplus"`` against such a server).

    **What it protects against.** An honest-but-curious server (and the transport) seeing the uploads: each u_i
    alone is uniformly distributed. Not covered: a server that lies about the public keys (no PKI or signatures) or
    about who dropped,
    colluding clients, what the sum itself reveals (use DPFedAvg for that) and the counts and losses in the clear.

    **Flower's SecAgg+** (``scheme="secaggplus"``, Flower engine only): the masking is Flower's ``secaggplus_mod``
    on each SuperNode instead (one key pair set per node and round, Shamir-shared secrets, dropouts tolerated down
    to the threshold; :mod:`fl_lightning.engines.flower_secagg`). The client half then leaves p_i Δ_i in its reply's
    payload for the site to hand to the mod (it never travels in the clear) and the server half adds the sum the
    transport unmasked, divided by the weight of the clients that answered. Error per entry and round ≤ m · 2c/T.

    Args:
        bits: Fraction bits of the fixed point (per-entry error ≤ 2^-(bits+1) per client).
        scheme: ``"pairwise"`` (this callback's own masks, any engine, no dropout) or ``"secaggplus"``.
        clipping_range: SecAgg+'s c: every entry of p_i Δ_i must lie in [-c, c].
        quantization_range: SecAgg+'s T: quantisation to integers in [0, T] (T < 2^31).
        modulus_range: SecAgg+'s modulus of the masks (a power of two above m · T).
        threshold: SecAgg+'s reconstruction threshold, as a fraction of the round's nodes (at least 2 nodes).

    """

    def __init__(
        self,
        *,
        bits: int = secagg.DEFAULT_BITS,
        scheme: str = "pairwise",
        clipping_range: float = 1.0,
        quantization_range: int = 2**30,
        modulus_range: int = 2**40,
        threshold: float = 0.5,
    ) -> None:
        super().__init__()
        if not 8 <= bits <= 52:
            raise ValueError(f"SecureAggregation bits must be in [8, 52], got {bits}")
        if scheme not in ("pairwise", "secaggplus"):
            raise ValueError(f"SecureAggregation scheme is 'pairwise' or 'secaggplus', not {scheme!r}")
        self.bits, self.scheme = bits, scheme
        # What the Flower engine checks (flower_secagg.Settings) and the sites' mod runs with.
        self.secaggplus = {
            "clipping_range": float(clipping_range),
            "quantization_range": int(quantization_range),
            "modulus_range": int(modulus_range),
            "threshold": float(threshold),
        }
        self.public_keys: dict[str, str] = {}  # client → hex public key (server state, checkpointed)
        self._weights: dict[str, float] = {}
        self._uploads: dict[str, torch.Tensor] = {}
        self._selected: list[str] = []
        self._round = 0
        self.remasked_rounds = 0  # rounds summed again without clients that did not answer

    @override
    def uploaded_keys(self, module: L.LightningModule, keys: set[str]) -> set[str]:
        return set()  # nothing of the model in the clear: the update is masked in a payload (or Flower's sum)

    @override
    def hides_updates(self) -> bool:
        return True  # the run's federated statistics are summed securely too (federation.stats_secure: None)

    # ------------------------------------------------------------------ server half
    @override
    def on_federation_start(self, server: ServerView) -> None:
        cfg = server.config
        if cfg.mode != "federated" or cfg.topology != "star" or len(server.groups) != 1:
            raise PreconditionError("SecureAggregation needs one global model (federation.topology=star, one group)")
        names = [type(cb).__name__ for cb in server.callbacks]
        bad = [n for n in names if n not in COMPATIBLE]
        if bad:
            why = "; ".join(
                f"{n}: {REFUSED_REASONS.get(n, 'not checked to work on the masked sum alone')}" for n in bad
            )
            raise PreconditionError(
                f"SecureAggregation hides every client's update from the server, which {bad} need ({why}); "
                f"it composes with {sorted(COMPATIBLE - {'SecureAggregation'})}"
            )
        private = set().union(*(cb.private_keys(server.module) for cb in server.callbacks))
        self._names = masked_names(server.groups[0].state, private)
        self._session = server.run_path.name if server.run_path is not None else ""
        if self.scheme == "secaggplus":
            if "secaggplus" not in getattr(server.transport, "secure_aggregation", ()):
                raise PreconditionError(
                    f"SecureAggregation(scheme='secaggplus') runs Flower's SecAgg+ on the Flower engine's SuperNodes; "
                    f"the {server.transport.name!r} transport does not (use scheme='pairwise')"
                )
            self.secaggplus["size"] = sum(server.groups[0].state[k].numel() for k in self._names)
            return  # no keys of ours: Flower's mod draws fresh ones on every node each round
        if not self.public_keys:  # else restored from a checkpoint, with the clients' private keys in theirs
            ids = list(server.data.client_ids)
            answers = server.query(self, "public_key", ids)
            self.public_keys = {c: str(answers[c]) for c in ids}

    @override
    def on_round_start(self, server: ServerView, round_idx: int, selected: list[str]) -> None:
        self._round, self._selected, self._uploads = round_idx, list(selected), {}
        # the weights the Federation gives the replies (public: the server knows every client's sample count)
        counts = [server.num_samples(c, server.groups[0]) for c in selected]
        self._weights = dict(zip(selected, aggregation_weights(counts, server.config.aggregation)))

    @override
    def configure_task(self, server: ServerView, task: Task) -> None:
        if self.scheme == "secaggplus":
            weight = self._weights[task.client_id]
            self.put_payload(task, {"weight": weight, secagg.SECAGGPLUS_SETTINGS: dict(self.secaggplus)})
            return
        self.put_payload(
            task,
            {
                "weight": self._weights[task.client_id],
                "peers": {c: self.public_keys[c] for c in self._selected},
                "session": self._session,
                "bits": self.bits,
            },
        )

    @override
    def on_reply(self, server: ServerView, task: Task, reply: Reply, weight: float) -> None:
        if self.scheme == "secaggplus":  # the update is in the transport's masked sum, not in the reply
            if reply.state or secagg.SECAGGPLUS_UPDATE in (self.get_payload(reply) or {}):
                raise ValueError(f"SecureAggregation: client {reply.client_id!r}'s update reached the server unmasked")
            self._uploads[reply.client_id] = torch.empty(0)
            return
        upload = (self.get_payload(reply) or {}).get("masked")
        if not isinstance(upload, torch.Tensor) or upload.dtype != torch.int64:
            raise ValueError(f"SecureAggregation: client {reply.client_id!r} sent no masked update")
        if abs(weight - self._weights[reply.client_id]) > 1e-12:  # the client scaled by another weight
            raise ValueError(
                f"SecureAggregation: client {reply.client_id!r} was given weight {self._weights[reply.client_id]} "
                f"but the Federation weighs it {weight}"
            )
        self._uploads[reply.client_id] = upload

    @override
    def on_mean(self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict) -> StateDict:
        missing = [c for c in self._selected if c not in self._uploads]
        if self.scheme == "secaggplus":
            # Σ p_i Δ_i over the clients that answered (SecAgg+ recovered the masks of those that dropped)
            summed = server.transport.take_secure_sum(self._round, group.name)  # type: ignore[attr-defined]
            if summed is None:
                raise RuntimeError(f"SecureAggregation: no SecAgg+ sum for round {self._round + 1}")
            total, members = summed  # renormalised over the updates in the sum, as FedAvg does without the rest
            total = total / sum(self._weights[c] for c in members)
        elif missing:
            total = self._sum_without(server, group, missing)
        else:
            total = secagg.unmasked_sum([self._uploads[c] for c in self._selected], self.bits)
        self._uploads = {}
        size = sum(previous[k].numel() for k in self._names)
        if total.numel() != size:
            raise ValueError(f"SecureAggregation: masked sum of {total.numel()} entries, the model shares {size}")
        out = {k: v.clone() for k, v in previous.items()}  # integer and private entries keep the global value
        at = 0
        for k in self._names:
            w = previous[k]
            delta = total[at : at + w.numel()].reshape(w.shape)
            out[k] = (w.detach().double().cpu() + delta).to(dtype=w.dtype, device=w.device)
            at += w.numel()
        return out

    def _sum_without(self, server: ServerView, group: ModelGroup, missing: list[str]) -> torch.Tensor:
        """Σ p_i Δ_i / Σ p_i over the clients that answered, their masks drawn again over them alone.

        The survivors' pairwise masks with a missing client do not cancel. Each survivor sends the correction
        new mask − old mask (:func:`~fl_lightning.ops.secagg.mask_correction`, fresh pair keys over the survivors);
        the server adds it to the upload it holds, and the survivors' masks cancel among themselves.
        """
        survivors = [c for c in self._selected if c in self._uploads]
        where = f"SecureAggregation: round {self._round + 1}'s selected client(s) {missing} did not answer"
        if len(survivors) < 2:  # one survivor's "sum" would be its own update in the clear
            raise RuntimeError(
                f"{where} and only {survivors} did: a masked sum needs two clients, so the round's aggregate is "
                "refused; fix the failing sites (or select more clients) and resume from the last checkpoint"
            )
        warnings.warn(f"{where}: their masks are drawn again over the {len(survivors)} that did", stacklevel=2)
        size = self._uploads[survivors[0]].numel()
        payload = {
            "round": self._round, "before": {c: self.public_keys[c] for c in self._selected},
            "after": {c: self.public_keys[c] for c in survivors}, "session": self._session,
            "retry": secagg.retry_session(self._session, missing), "size": size,
        }  # fmt: skip
        answers = server.query(self, "remask", survivors, payload, group=group.name)
        for cid, correction in answers.items():
            if (
                not isinstance(correction, torch.Tensor)
                or correction.dtype != torch.int64
                or correction.numel() != size
            ):
                raise RuntimeError(f"{where}, and client {cid!r} sent no mask correction: the round cannot be summed")
        self.remasked_rounds += 1
        total = secagg.unmasked_sum([*(self._uploads[c] for c in survivors), *answers.values()], self.bits)
        return total / sum(self._weights[c] for c in survivors)  # renormalised, as FedAvg does without them

    @override
    def summary_entries(self, server: ServerView) -> dict[str, Any]:
        if self.scheme == "secaggplus":
            return {"secure_aggregation": {"scheme": self.scheme, **self.secaggplus}}
        return {
            "secure_aggregation": {
                "bits": self.bits, "clients_with_keys": len(self.public_keys), "remasked_rounds": self.remasked_rounds,
            }
        }  # fmt: skip

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"public_keys": dict(self.public_keys), "remasked_rounds": self.remasked_rounds}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.public_keys = {str(c): str(k) for c, k in state_dict["public_keys"].items()}
        self.remasked_rounds = int(state_dict.get("remasked_rounds", 0))

    # ------------------------------------------------------------------ client half
    @override
    def answer_query(self, ctx: ClientContext, name: str, payload: Any) -> Any:
        if name == "public_key":
            if "private_key" not in ctx.state:  # the secret never leaves the client (but is in its checkpoint)
                ctx.state["private_key"] = secagg.generate_private_key().hex()
            return secagg.public_key(bytes.fromhex(ctx.state["private_key"])).hex()
        if name == "remask":
            return self._mask_correction(ctx, payload)
        return super().answer_query(ctx, name, payload)

    def _mask_correction(self, ctx: ClientContext, payload: dict[str, Any]) -> torch.Tensor:
        """The client's new mask − old mask for a round summed again without the clients that did not answer.

        Only for the round it masked last, over peers it masked with, itself and one other at least: anything
        else could make its own upload readable.
        """
        masked = ctx.state.get("masked")
        before, after = dict(payload["before"]), dict(payload["after"])
        checks = {
            "it masked no upload of that round": masked is not None and masked[:2] == [payload["round"], ctx.group],
            "the peers it masked with are not those": masked is not None and sorted(before) == masked[2],
            "the new peers are not two or more of the old ones with it": (
                ctx.client_id in after and len(after) >= 2 and set(after) < set(before)
            ),
        }
        bad = [why for why, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"SecureAggregation: client {ctx.client_id!r} refuses to re-mask: {'; '.join(bad)}")
        correction = secagg.mask_correction(
            ctx.client_id,
            bytes.fromhex(ctx.state["private_key"]),
            {c: bytes.fromhex(k) for c, k in before.items()},
            {c: bytes.fromhex(k) for c, k in after.items()},
            int(payload["size"]),
            (str(payload["session"]), str(payload["retry"])),
            int(payload["round"]),
            ctx.group,
        )
        return torch.from_numpy(correction.view(np.int64).copy())

    @override
    def on_upload(self, ctx: ClientContext, reply: Reply) -> None:
        task = ctx.payload
        if self.scheme == "secaggplus" and task is not None and ctx.received is not None:
            names = masked_names(ctx.received, ctx.private_keys)
            update = flat_update(reply.state, ctx.received, names) * float(task["weight"])
            self.put_payload(reply, {secagg.SECAGGPLUS_UPDATE: update})  # the site hands it to Flower's mod
            reply.state = {}
            return
        if task is None or "private_key" not in ctx.state or ctx.received is None:
            raise PreconditionError(
                f"SecureAggregation: client {ctx.client_id!r} has no key pair or task payload (was the server's "
                "public_key query skipped?)"
            )
        peers = {c: bytes.fromhex(k) for c, k in task["peers"].items()}
        if ctx.client_id not in peers:
            raise ValueError(f"SecureAggregation: client {ctx.client_id!r} is not among the round's peers")
        names = masked_names(ctx.received, ctx.private_keys)
        update = flat_update(reply.state, ctx.received, names) * float(task["weight"])
        bits = int(task["bits"])
        mask = secagg.client_mask(
            ctx.client_id,
            bytes.fromhex(ctx.state["private_key"]),
            peers,
            update.numel(),
            str(task["session"]),
            ctx.round,
            ctx.group,
        )
        self.put_payload(reply, {"masked": secagg.masked_upload(update, mask, bits, len(peers))})
        ctx.state["masked"] = [ctx.round, ctx.group, sorted(peers)]  # what a re-mask of this round may ask for
        reply.state = {}  # nothing of the model travels in the clear
