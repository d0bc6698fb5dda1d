"""A callback that holds each run before a round until a file exists: a sweep's kill lands between two rounds."""

from __future__ import annotations

import time
from pathlib import Path

from typing_extensions import override

from fl_lightning.callback import FederatedCallback


class Gate(FederatedCallback):
    """Before round ``at`` (1-based) and later ones, wait until ``path`` exists; nothing else.

    The kill test starts a sweep with the gate closed: every trial writes its round-1 checkpoint and waits, so the
    SIGKILL finds trials that have a checkpoint and have not finished, whatever the machine's speed. It changes no
    state, so a run with the gate open trains exactly as one without it.

    Args:
        path: The file whose existence opens the gate.
        at: The first round held.
    """

    def __init__(self, path: str, at: int = 2) -> None:
        self.path, self.at = path, at

    @override
    def on_round_start(self, server, round_idx: int, selected: list[str]) -> None:
        while round_idx + 1 >= self.at and not Path(self.path).exists():
            time.sleep(0.05)
