"""``compare --format flamby``: runs as rows of FLamby's result CSVs, so they can be drawn into its bar chart.

FLamby's benchmark CSVs (``flamby/results/results_benchmark_fed_*/*.csv``) hold one row per method, test set and
seed, with the value in ``Metric``: test sets ``client_test_<i>`` (the i-th centre) and ``Pooled Test``. A run
gives one row per client (in the run's client order) and its pooled test set; a run with ``cross_site.csv``
(``local`` mode) gives every client's own model as ``Local <i>``, as FLamby's single-centre baselines.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fl_lightning.server.cross_site import CROSS_SITE_CSV, POOLED_COLUMN, read_cross_site
from fl_lightning.tools.compare.runs import CompareRefused, Run, method_labels

FLAMBY_CSV = "results_flamby.csv"
COLUMNS = ["seed", "Method", "Test", "Metric", "metric_name", "client"]
POOLED_TEST = "Pooled Test"


def _tests(per_client: dict[str, float], pooled: float | None, order: list[str]) -> list[tuple[str, str, float]]:
    rows = [(f"client_test_{i}", c, per_client[c]) for i, c in enumerate(order) if c in per_client]
    if pooled is not None:
        rows.append((POOLED_TEST, "", pooled))
    return rows


def flamby_rows(runs: Sequence[Run], metric: str) -> list[dict[str, Any]]:
    """Every run's rows in FLamby's schema (plus the metric's and the client's name).

    Raises:
        CompareRefused: If a run did not record ``metric``, naming it.
    """
    labels = method_labels(runs)
    rows: list[dict[str, Any]] = []
    for run in runs:
        order = list(run.summary.get("clients", {}))
        cross = run.path / CROSS_SITE_CSV
        if cross.is_file():
            matrix = read_cross_site(cross)
            for i, holder in enumerate(order):
                per = {t: m[metric] for t, m in matrix.get(holder, {}).items() if metric in m}
                pooled = per.pop(POOLED_COLUMN, None)
                for test, client, value in _tests(per, pooled, order):
                    rows.append(_row(run, f"Local {i}", test, value, metric, client))
            continue
        model = "global" if any("global" in v for v in run.summary.get("clients", {}).values()) else "personal"
        per = {c: v[model][metric] for c, v in run.summary.get("clients", {}).items() if metric in v.get(model, {})}
        if not per:
            raise CompareRefused(f"{run.path}: its summary.json holds no {model} {metric!r} per client")
        pooled = run.summary.get("pooled", {}).get(metric) if model == "global" else None
        for test, client, value in _tests(per, pooled, order):
            rows.append(_row(run, labels[run.path], test, value, metric, client))
    return rows


def _row(run: Run, method: str, test: str, value: float, metric: str, client: str) -> dict[str, Any]:
    return {"seed": run.seed, "Method": method, "Test": test, "Metric": value, "metric_name": metric, "client": client}


def write_flamby(runs: Sequence[Run], metric: str, out: Path) -> Path:
    """Write :data:`FLAMBY_CSV` into ``out``; its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / FLAMBY_CSV
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(flamby_rows(runs, metric))
    return path
