"""Flower's SecAgg+ around our fit tasks: its ClientApp mod on the sites, its four stages driven by our transport.

**Why not Flower's ``SecAggPlusWorkflow``.** The server half of Flower 1.42's SecAgg+ is a ``ServerApp`` workflow
bound to a ``LegacyContext`` and a legacy ``Strategy`` (``configure_fit``/``aggregate_fit``): it owns the round loop,
which our :class:`~fl_lightning.server.federation.Federation`
owns. Its client half, ``secaggplus_mod``, is independent of
the message's content except for three things: it acts on ``train`` messages carrying a ``ConfigRecord``
:data:`RECORD_KEY_CONFIGS`; in its masking stage its reply must hold a legacy ``FitRes`` (``fitres.parameters``,
``fitres.num_examples``, ...) whose parameters it masks; and it then *clears every* ``ArrayRecord`` of the reply.
So the sites run the unchanged mod (:func:`client_mod`), and :func:`secure_fit` is the workflow's four stages
(setup, share keys, collect masked vectors, unmask) re-implemented from Flower's building blocks around one
wave of our fit tasks; our encoded reply travels as bytes in a ``ConfigRecord`` (:data:`REPLY_RECORD`), which the
mod leaves alone, and the update travels only as the mod's masked vector.

**What is summed.** The client callback (:class:`callbacks.SecureAggregation` with ``scheme="secaggplus"``) puts
``p_i Δ_i`` (its aggregation weight times its update, flat float64) in its reply's payload under :data:`UPDATE`;
the site takes it out before encoding the reply (:func:`take_update`) and hands it to the mod as the
``FitRes``' only array with ``num_examples = 1`` (with ``max_weight = 1`` the mod's own weighting is exact: the
weights are public and already applied). The server learns ``Σ_i p_i Δ_i`` over the surviving clients, within
``n · 2c / T`` per entry (Flower's stochastic quantisation to ``[0, T]`` after clipping to ``[-c, c]``).

**Dropouts.** Every selected node shares its secrets (Shamir, threshold ``t``) with every other (SecAgg+ with a
complete graph). A node lost after sharing its keys is a failed client: the others' shares of its key remove its
pairwise masks, as long as at least ``t`` nodes answer the unmask stage.

**Not covered** (Flower's implementation, kept as is): the masks come from numpy's ``RandomState`` seeded with
32 bits of the agreed key, which is no cryptographic PRG; the server is trusted to relay public keys honestly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Status, bytes_to_ndarray, ndarrays_to_parameters
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_extract,
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fl_lightning.ops.secagg import SECAGGPLUS_SETTINGS, SECAGGPLUS_UPDATE

# A fit task's callback payload entry holding the protocol's settings; a fit reply's holding p_i Δ_i (the site
# takes it out before encoding the reply).
SECAGGPLUS, UPDATE = SECAGGPLUS_SETTINGS, SECAGGPLUS_UPDATE
REPLY_RECORD = "fl.reply"  # ConfigRecord carrying our encoded reply where the mod clears every ArrayRecord

# Pushes ``(node, content)`` as ``train`` messages; returns each one's reply, or why there is none, in order.
Send = Callable[[list[tuple[int, RecordDict]]], list["Message | str"]]


@dataclass(frozen=True)
class Settings:
    """SecAgg+ parameters (Flower's names).

    Attributes:
        clipping_range: c: every entry of p_i Δ_i must lie in [-c, c] (a site refuses a larger one: clipping
            would bias the sum silently).
        quantization_range: T: entries are quantised to integers in [0, T] (T < 2^31: Flower rounds into int32).
        modulus_range: The masks' modulus (a power of two, at least n · T).
        threshold: Fraction of the round's nodes (at least 2) whose shares rebuild a secret: up to
            n − ⌈threshold · n⌉ nodes may drop after sharing their keys.
        size: Entries of every client's update vector (the server checks the masked vectors against it).

    """

    clipping_range: float = 1.0
    quantization_range: int = 2**30
    modulus_range: int = 2**40
    threshold: float = 0.5
    size: int = 0

    def __post_init__(self) -> None:
        if not self.clipping_range > 0:
            raise ValueError(f"SecAgg+ clipping_range must be positive, got {self.clipping_range}")
        if not 1 <= self.quantization_range < 2**31:
            raise ValueError(f"SecAgg+ quantization_range must lie in [1, 2^31), got {self.quantization_range}")
        m = self.modulus_range
        if m & (m - 1) or not self.quantization_range < m <= 2**62:
            raise ValueError(f"SecAgg+ modulus_range must be a power of two in (quantization_range, 2^62], got {m}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"SecAgg+ threshold must be a fraction in (0, 1], got {self.threshold}")

    @classmethod
    def of_task(cls, payloads: dict[str, Any]) -> Settings | None:
        """The settings a fit task's callback payloads ask for, or ``None`` (a plain fit)."""
        for payload in payloads.values():
            if isinstance(payload, dict) and isinstance(payload.get(SECAGGPLUS), dict):
                return cls(**payload[SECAGGPLUS])
        return None

    def quantum(self) -> float:
        """One quantisation step 2c/T: the per-entry error bound of one client's contribution."""
        return 2 * self.clipping_range / self.quantization_range


# ---------------------------------------------------------------------------------------------------- site
def client_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` for the messages of the protocol; every other message goes straight through.

    The mod alone would take every ``train`` message for a SecAgg+ stage (a plain fit has no stage record).
    """
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


def take_update(reply: Any) -> np.ndarray:
    """Remove p_i Δ_i from a fit reply's payloads (it must not travel in the clear); return it as float64.

    Raises:
        ValueError: If no callback put one there (SecAgg+ was asked for, but no client half answered it).

    """
    for payload in reply.payloads.values():
        if isinstance(payload, dict) and UPDATE in payload:
            value = payload.pop(UPDATE)
            return np.ascontiguousarray(value.detach().cpu().double().numpy().reshape(-1))
    raise ValueError(f"client {reply.client_id!r}: a SecAgg+ fit without an update to mask")


def fitres_records(update: np.ndarray, settings: Settings) -> RecordDict:
    """The legacy ``FitRes`` records the mod masks: the update as the only array, ``num_examples`` = 1.

    Raises:
        OverflowError: If an entry lies outside the clipping range (Flower would clip it: a silent bias).

    """
    peak = float(np.abs(update).max()) if update.size else 0.0
    if peak > settings.clipping_range:
        raise OverflowError(
            f"an update entry of {peak:.3g} exceeds SecAgg+'s clipping_range {settings.clipping_range}: raise it"
        )
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([update]), num_examples=1, metrics={})
    return compat.fitres_to_recorddict(fitres, keep_input=False)


# ---------------------------------------------------------------------------------------------------- server
def secure_fit(
    send: Send, contents: dict[int, RecordDict], settings: Settings
) -> tuple[dict[int, Message | str], np.ndarray | None]:
    """One wave of fit tasks (one per node) under SecAgg+: the four stages of Flower's workflow.

    Args:
        send: Pushes ``(node, content)`` as ``train`` messages; returns each one's reply (or why there is none).
        contents: Node id → the fit task's records (our :func:`~fl_lightning.engines.flower.pack`).
        settings: The protocol's parameters.

    Returns:
        Node id → its masking stage's reply (our encoded reply inside) or why it failed; and the unmasked
        float64 Σ p_i Δ_i over the nodes that delivered a masked vector (``None`` if fewer than the threshold did).

    """
    nodes, size = sorted(contents), settings.size
    n = len(nodes)
    if n < 2:
        raise ValueError("SecAgg+ needs at least two nodes in a round")
    threshold = max(2, math.ceil(settings.threshold * n))
    failed: dict[int, Message | str] = {}

    def stage(targets: list[int], make: Callable[[int], RecordDict]) -> dict[int, Message]:
        out = {}
        for nid, reply in zip(targets, send([(nid, make(nid)) for nid in targets])):
            if isinstance(reply, str):
                failed[nid] = reply
            elif reply.has_error():
                failed[nid] = f"{reply.error.reason} (code {reply.error.code})"
            else:
                out[nid] = reply
        return out

    def records(cfg: dict[str, Any], base: RecordDict | None = None) -> RecordDict:
        content = base if base is not None else RecordDict()
        content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(cfg)
        return content

    def configs(reply: Message) -> ConfigRecord:
        return reply.content.config_records[RECORD_KEY_CONFIGS]

    # Stage 0: every node draws two key pairs (masking, encrypting its shares) and answers the public keys.
    setup = {
        Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: n, Key.SHARE_NUMBER: n, Key.THRESHOLD: threshold,
        Key.CLIPPING_RANGE: float(settings.clipping_range), Key.TARGET_RANGE: int(settings.quantization_range),
        Key.MOD_RANGE: int(settings.modulus_range), Key.MAX_WEIGHT: 1.0,
    }  # fmt: skip
    got = stage(nodes, lambda nid: records(dict(setup)))
    keys = {
        nid: [cast(bytes, configs(r)[Key.PUBLIC_KEY_1]), cast(bytes, configs(r)[Key.PUBLIC_KEY_2])]
        for nid, r in got.items()
    }  # noqa: E501
    if len(keys) < threshold:
        return _all_failed(nodes, failed, "SecAgg+ setup"), None
    # Stage 1: each node Shamir-shares its mask seed and masking key, encrypted for each peer; we relay them.
    active = sorted(keys)
    got = stage(active, lambda nid: records({**{str(j): keys[j] for j in active}, Key.STAGE: Stage.SHARE_KEYS}))
    sharing = sorted(got)
    fwd: dict[int, tuple[list[int], list[bytes]]] = {nid: ([], []) for nid in sharing}
    for src, reply in got.items():
        for dst, ctxt in zip(configs(reply)[Key.DESTINATION_LIST], configs(reply)[Key.CIPHERTEXT_LIST], strict=True):
            if dst in fwd:
                fwd[cast(int, dst)][0].append(src)
                fwd[cast(int, dst)][1].append(cast(bytes, ctxt))
    if len(sharing) < threshold:
        return _all_failed(nodes, failed, "SecAgg+ key sharing"), None
    # Stage 2: the fit itself; the mod masks the update and clears it from the reply.
    got = stage(
        sharing,
        lambda nid: records(
            {Key.STAGE: Stage.COLLECT_MASKED_VECTORS, Key.SOURCE_LIST: fwd[nid][0], Key.CIPHERTEXT_LIST: fwd[nid][1]},
            contents[nid],
        ),
    )
    total: list[np.ndarray] | None = None
    for nid, reply in got.items():
        vector = [bytes_to_ndarray(b) for b in cast(list[bytes], configs(reply)[Key.MASKED_PARAMETERS])]
        if [v.shape for v in vector] != [(1,), (size,)]:
            failed[nid] = f"SecAgg+ masked vector of shapes {[v.shape for v in vector]}, expected [(1,), ({size},)]"
            continue
        total = vector if total is None else parameters_addition(total, vector)
    survivors = sorted(nid for nid in got if nid not in failed)
    dead = [nid for nid in sharing if nid not in survivors]
    replies: dict[int, Message | str] = {**failed, **{nid: got[nid] for nid in survivors}}
    if total is None or len(survivors) < threshold:
        return _all_failed(nodes, replies, "SecAgg+ masking"), None
    # Stage 3: survivors send their shares of the survivors' mask seeds and of the dead nodes' masking keys.
    unmask = {Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: survivors, Key.DEAD_NODE_ID_LIST: dead}
    got = stage(survivors, lambda nid: records(dict(unmask)))
    shares: dict[int, list[bytes]] = {nid: [] for nid in sharing}
    for reply in got.values():
        for owner, share in zip(configs(reply)[Key.NODE_ID_LIST], configs(reply)[Key.SHARE_LIST], strict=True):
            shares[cast(int, owner)].append(cast(bytes, share))
    total = parameters_mod(total, settings.modulus_range)
    shapes = [v.shape for v in total]
    for nid, share_list in shares.items():
        if len(share_list) < threshold:
            return _all_failed(nodes, replies, f"SecAgg+ unmasking (too few shares of node {nid})"), None
        secret = combine_shares(share_list)
        if nid in survivors:  # its own mask
            total = parameters_subtraction(total, pseudo_rand_gen(secret, settings.modulus_range, shapes))
            continue
        for peer in sharing:  # a dead node's pairwise masks, rebuilt from its masking key
            if peer == nid:
                continue
            key = generate_shared_key(bytes_to_private_key(secret), bytes_to_public_key(keys[peer][0]))
            mask = pseudo_rand_gen(key, settings.modulus_range, shapes)
            total = parameters_addition(total, mask) if nid > peer else parameters_subtraction(total, mask)
    factor, (summed,) = factor_extract(parameters_mod(total, settings.modulus_range))
    if int(factor) != len(survivors) * settings.quantization_range:  # each node's weight factor is T (weight 1)
        raise ValueError(f"SecAgg+ weight factor {int(factor)}: not {len(survivors)} nodes of weight 1")
    # Each quantised entry is (x + c) · T / 2c: the sum over the survivors is Σx · T/2c + n_s · T/2.
    values = summed.astype(np.float64) * settings.quantum() - len(survivors) * settings.clipping_range
    return replies, values


def masked_bytes(reply: Message | str) -> int:
    """Bytes of the masked vector in a masking stage's reply (for ``rounds.csv``'s upload count)."""
    if isinstance(reply, str) or reply.has_error() or RECORD_KEY_CONFIGS not in reply.content.config_records:
        return 0
    vector = reply.content.config_records[RECORD_KEY_CONFIGS].get(Key.MASKED_PARAMETERS, [])
    return sum(len(b) for b in cast(list[bytes], vector))


def _all_failed(nodes: list[int], replies: dict[int, Message | str], stage: str) -> dict[int, Message | str]:
    """Every node's fit failed: below the threshold the masked sum cannot be recovered."""
    return {nid: f"{stage} fell below the threshold ({replies.get(nid, 'answered')})" for nid in nodes}
