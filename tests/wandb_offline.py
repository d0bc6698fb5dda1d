"""Read a W&B offline run file (``run-<id>.wandb``) without network or wandb's service.

The file is W&B's datastore format: a 7-byte header (":W&B", magic 0xBEE1, version 0) followed by
LevelDB-log records in 32 KiB blocks; each record payload is a protobuf ``Record``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    """All protobuf records of an offline run file, in order."""
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, "not a W&B datastore file"
    pos, records, pending = _HEADER, [], b""
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        payload = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            break
        if kind in (_FULL, _FIRST):
            pending = payload
        else:
            pending += payload
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history_and_config(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any], list[Any]]:
    """The logged history rows (key → JSON text), the config items, and the metric definitions."""
    history, config, metrics = [], {}, []
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
        elif kind == "config":
            config.update({item.key or "/".join(item.nested_key): item.value_json for item in record.config.update})
        elif kind == "metric":
            metrics.append(record.metric)
    return history, config, metrics
