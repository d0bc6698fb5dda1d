"""Compare finished runs method by method over seeds: ``python -m fl_lightning.tools.compare RUN_DIR [RUN_DIR ...]``.

The command's arguments, the printed table and the files written into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from fl_lightning.tools.compare.figure import plot_curves
from fl_lightning.tools.compare.flamby import FLAMBY_CSV, write_flamby
from fl_lightning.tools.compare.runs import CompareRefused, load_run
from fl_lightning.tools.compare.table import compare, markdown, print_line, print_table

COMMAND = "python -m fl_lightning.tools.compare"
DEFAULT_OUT = Path("comparison")


def write_outputs(comparison: Mapping[str, Any], out: Path) -> list[Path]:
    """Write ``comparison.md``, ``comparison.json`` and (with curves) ``comparison.png`` into ``out``.

    Returns:
        The files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "comparison.md", out / "comparison.json"]
    written[0].write_text(markdown(comparison), encoding="utf-8")
    written[1].write_text(json.dumps(comparison, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    if plot_curves(comparison, out / "comparison.png"):
        written.append(out / "comparison.png")
    return written


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    """Compare run directories: print the table, write ``comparison.md``/``.json``/``.png`` into ``--out``.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).
        console: Where to print the table (default: a Rich console on stdout).

    Returns:
        0 when the comparison was written, 2 when refused (unreadable run, differing settings, repeated seed,
        unknown metric).
    """
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="finished run directories")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./comparison)")
    parser.add_argument("--metric", default=None, help="metric to compare (default: the runs' primary metric)")
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="KEY",
        help="a flattened config key (or fnmatch pattern) that may differ between runs, e.g. model.init_args.norm",
    )
    parser.add_argument(
        "--format",
        choices=("table", "flamby"),
        default="table",
        help="table (default): the comparison table and files; flamby: FLamby's result CSV schema "
        f"({FLAMBY_CSV}: Method, Test, Metric, seed), one row per run, test set and seed",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        runs = [load_run(path) for path in args.run_dirs]
        if args.format == "flamby":
            metric = args.metric or "acc"
            print(f"wrote {write_flamby(runs, metric, args.out)}")
            return 0
        comparison = compare(runs, args.metric, args.allow)
    except CompareRefused as err:
        print(f"{COMMAND}: refused: {err}", file=sys.stderr)
        return 2
    console = console or Console()
    print_table(console, comparison)
    for path in write_outputs(comparison, args.out):
        print_line(console, f"wrote {path}")
    return 0
