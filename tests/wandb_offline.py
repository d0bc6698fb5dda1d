"""Read a W&B offline run file (``run-<id>.wandb``) without network or wandb's service.

The reader is the library's (:func:`fl_lightning.tools.wandb_sync.read_records`: the transaction log's LevelDB-log
records as protobuf ``Record`` objects); this module adds what the tests look at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fl_lightning.tools.wandb_sync import read_records

__all__ = ["history_and_config", "read_records"]


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
