"""``python -m fl_lightning.stats --config CONFIG [overrides]``: federated statistics of every site's data.

The same config and engines as training (``train.py``), with ``federation.mode=stats``: each client's site
releases summaries of its data (counts, label prevalence, intensity histograms or column means; small cells
withheld by ``federation.stats_min_count``, Gaussian noise with ``federation.stats_epsilon``), the server prints
the per-site table with the pooled row and writes ``stats.json`` and ``stats.png`` in a run directory.
"""

from __future__ import annotations

import sys
from typing import Any

from fl_lightning.cli import main as train


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the statistics for the config in ``argv``; returns ``stats.json``'s content."""
    args = list(sys.argv[1:] if argv is None else argv)
    return train([*args, "--federation.mode=stats"])


if __name__ == "__main__":
    main()
