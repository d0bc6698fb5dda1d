"""Compare finished runs method by method over seeds: ``python -m fl_lightning.tools.compare RUN_DIR [RUN_DIR ...]``.

Usage::

    python -m fl_lightning.tools.compare runs/fedavg-s0 runs/fedavg-s1 runs/fedbn-s0 runs/fedbn-s1 [--out comparison]
        [--metric acc] [--allow model.init_args.norm]

Each run directory must hold the ``config.yaml`` and ``summary.json`` of a finished run (``rounds.csv`` too for the
curves). The runs are grouped by method, and refused (exit status 2) when a setting other than the method and the
seed differs (``--allow KEY`` lets a key differ) or two runs of one method have the same seed (:mod:`.runs`). One row
per method gives mean ± sample std (ddof=1) over seeds of the primary metric (``--metric`` chooses another) and how
many seeds collapsed (:mod:`.table`). The table is printed and written to ``--out`` (default ``comparison/``) as
``comparison.md``, with the numbers in ``comparison.json`` and the per-round curves in ``comparison.png``
(:mod:`.figure`); :mod:`.cli` is the command.
"""

from fl_lightning.tools.compare.cli import main, write_outputs
from fl_lightning.tools.compare.figure import plot_curves
from fl_lightning.tools.compare.runs import (
    IGNORED,
    CompareRefused,
    Run,
    check_comparable,
    check_unique_seeds,
    config_differences,
    group_by_method,
    load_run,
    method_name,
)
from fl_lightning.tools.compare.table import compare, default_metric, markdown, rich_table, table_rows

__all__ = [
    "IGNORED",
    "CompareRefused",
    "Run",
    "check_comparable",
    "check_unique_seeds",
    "compare",
    "config_differences",
    "default_metric",
    "group_by_method",
    "load_run",
    "main",
    "markdown",
    "method_name",
    "plot_curves",
    "rich_table",
    "table_rows",
    "write_outputs",
]
