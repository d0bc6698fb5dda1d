"""The Flower engine's records: our encoded messages in and out of Flower ``RecordDict``s, checked on arrival.

A task or reply travels as one ``uint8`` :class:`flwr.app.Array` (``stype`` :data:`STYPE`) in the ``ArrayRecord``
:data:`MSG`, its routing facts in the ``ConfigRecord`` :data:`META` (:mod:`fl_lightning.engines.flower`, "Wire
format"). What arrives is untrusted: :func:`unpack` and :func:`parse_description` check it before anything is
decoded, and raise :class:`~fl_lightning.wire.protocol.MessageError` naming what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl_lightning.engines import flower_secagg as secaggplus
from fl_lightning.wire import protocol

MSG, META, STYPE = "fl.msg", "fl.meta", "fl_lightning.message"
DESCRIBE, RESTORE = "describe", "restore"
PRECONDITION = "precondition"  # a reply's routing fact: the method cannot work on this site (PreconditionError)
SHARED_KEYS = ("num_classes", "in_channels", "image_size", "batch_size", "seed")  # the same on every site


def pack(data: bytes, **meta: Any) -> RecordDict:
    """Encoded message bytes (and routing facts) → a Flower ``RecordDict``."""
    array = Array(dtype="uint8", shape=(len(data),), stype=STYPE, data=data)
    meta = {k: v for k, v in meta.items() if v is not None}
    return RecordDict({MSG: ArrayRecord({"message": array}), META: ConfigRecord(meta)})


def unpack(content: RecordDict) -> tuple[bytes, dict[str, Any]]:
    """A ``RecordDict`` from :func:`pack` → the encoded bytes and the routing facts (nothing decoded yet).

    Raises:
        protocol.MessageError: If the records are not what :func:`pack` writes: one flat ``uint8`` array of
            :data:`STYPE` whose shape matches its bytes (at most :data:`protocol.MAX_BYTES`), and routing facts of
            :data:`META_TYPES` only.

    """
    try:
        meta = dict(content.config_records.get(META, ConfigRecord()))
        if MSG not in content.array_records and secaggplus.REPLY_RECORD in content.config_records:
            # a SecAgg+ fit reply: the mod clears every ArrayRecord, so the bytes travel in a ConfigRecord
            data = content.config_records[secaggplus.REPLY_RECORD]["message"]
            if not isinstance(data, bytes) or len(data) > protocol.MAX_BYTES:
                raise protocol.MessageError(
                    f"a SecAgg+ reply carries {type(data).__name__}, not at most MAX_BYTES bytes"
                )
            _check_meta(meta)
            return data, meta
        array = content.array_records[MSG]["message"]
    except (KeyError, AttributeError, TypeError) as err:
        raise protocol.MessageError(f"not an fl_lightning Flower message (missing {err})") from None
    if not isinstance(array, Array) or array.stype != STYPE or array.dtype != "uint8":
        what = f"{array.dtype}/{array.stype}" if isinstance(array, Array) else type(array).__name__
        raise protocol.MessageError(f"unexpected array {what} in an fl_lightning message")
    data, shape = array.data, array.shape
    flat = isinstance(data, bytes) and isinstance(shape, (list, tuple)) and list(shape) == [len(data)]
    if not flat or len(data) > protocol.MAX_BYTES:
        size = len(data) if isinstance(data, bytes) else type(data).__name__
        raise protocol.MessageError(f"the message array's shape {array.shape} does not match its {size} bytes")
    _check_meta(meta)
    return data, meta


# Routing facts a message may carry in "fl.meta", and their types.
META_TYPES: dict[str, type] = {"op": str, "run": str, "round": int, "keep_from": int, PRECONDITION: str}
_OPS = ("task", DESCRIBE, RESTORE)


def _check_meta(meta: dict[str, Any]) -> None:
    for key, value in meta.items():
        kind = META_TYPES.get(key)
        if kind is None:
            raise protocol.MessageError(f"unknown routing fact {key!r} in an fl_lightning message")
        if type(value) is not kind:  # exactly: a bool is no round
            raise protocol.MessageError(f"routing fact {key!r} must be {kind.__name__}, not {type(value).__name__}")
    if meta.get("op", "task") not in _OPS:
        raise protocol.MessageError(f"unknown operation {meta['op']!r} (one of {', '.join(_OPS)})")
    if meta.get("round", 0) < 0:
        raise protocol.MessageError(f"negative round {meta['round']} in an fl_lightning message")


def parse_description(data: bytes, node: int) -> dict[str, Any]:
    """A node's answer to ``describe`` (:meth:`~fl_lightning.engines.flower_site.Site.describe`), checked.

    Raises:
        protocol.MessageError: If it is not that JSON object (its keys, client ids with two sample counts,
            positive sizes), naming the node.

    """
    try:
        if len(data) > protocol.MAX_HEADER_BYTES:
            raise ValueError(f"{len(data)} bytes is more than a description needs")
        desc = json.loads(data.decode("utf-8"))
        _check_description(desc)
    except (ValueError, RecursionError) as err:  # MessageError is a ValueError, as are JSON's and UTF-8's errors
        raise protocol.MessageError(f"SuperNode {node} described itself wrongly: {err}") from None
    return desc


def _check_description(desc: Any) -> None:
    keys = {"clients", *SHARED_KEYS}
    if not isinstance(desc, dict) or not keys <= desc.keys() <= keys | {"partitions"}:
        raise ValueError(f"expected an object of {sorted(keys)} (and 'partitions'), got {_brief(desc)}")
    clients = desc["clients"]
    if not isinstance(clients, dict) or not all(
        cid and isinstance(n, list) and len(n) in (2, 3) and all(type(x) is int and x >= 0 for x in n)
        for cid, n in clients.items()
    ):
        raise ValueError(
            f"'clients' maps client ids to [train samples, test samples, validation samples], not {_brief(clients)}"
        )
    positive = {k: desc[k] for k in ("batch_size", "num_classes", "in_channels", "partitions") if k in desc}
    for key, value in positive.items():
        if type(value) is not int or value < 1:
            raise ValueError(f"{key!r} is a positive integer, not {value!r}")
    size = desc["image_size"]
    if not isinstance(size, list) or not 1 <= len(size) <= 3 or not all(type(s) is int and s >= 1 for s in size):
        raise ValueError(f"'image_size' is a list of positive integers, not {_brief(size)}")
    if type(desc["seed"]) is not int:
        raise ValueError(f"'seed' is an integer, not {desc['seed']!r}")


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
