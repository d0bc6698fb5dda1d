"""A tiny clinical table (three hospitals) and the ``train.py`` arguments that run a method on it."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import yaml

SITES = ("site0", "site1", "site2")
NUMERIC = ("age", "bp", "chol", "hr", "oldpeak")
CATEGORIES = ("1", "2", "3")  # the categorical column ``cp``


def write_table(root: Path, rows_per_site: int = 40) -> Path:
    """``root/site{0,1,2}.csv``: 5 numeric features and a categorical one, a label that depends on them.

    Each site shifts and scales its numbers (feature shift across hospitals); the label is a noisy threshold of a
    linear score, so a model can learn it and both classes occur at every site.
    """
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for s, site in enumerate(SITES):
        numbers = rng.normal(size=(rows_per_site, len(NUMERIC)))
        cp = rng.integers(0, len(CATEGORIES), rows_per_site)
        score = numbers[:, 0] - numbers[:, 2] + 0.8 * (cp == 2) + 0.3 * rng.normal(size=rows_per_site)
        label = (score > np.median(score)).astype(int)
        with (root / f"{site}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([*NUMERIC, "cp", "label"])
            for i in range(rows_per_site):
                shifted = 10 * (s + 1) + (1 + s) * numbers[i]
                writer.writerow([*(f"{v:.4f}" for v in shifted), CATEGORIES[cp[i]], label[i]])
    return root


def table_args(tmp_path: Path, run_name: str, model: dict[str, Any] | None = None, **overlay: Any) -> list[str]:
    """``train.py`` arguments for two quick rounds of a tabular client on :func:`write_table`'s table.

    The settings go into a YAML file in ``tmp_path``; the run writes ``tmp_path / "runs" / run_name`` without a
    logger, plots, checkpoints or printing.

    Args:
        tmp_path: Where the table, the config and the run directory go.
        run_name: The run directory's name.
        model: The tabular client's init args over the defaults (logistic regression, plain SGD, lr 0.05).
        **overlay: Top-level sections merged over the config's (``federation``, ``trainer``), e.g. a method's
            callbacks.
    """
    root = tmp_path / "table"
    if not root.exists():
        write_table(root)
    config: dict[str, Any] = {
        "seed_everything": 0,
        "federation": {"rounds": 2, "local_steps": 3, "eval_every": 1},
        "model": {
            "class_path": "fl_lightning.clients.TabularClient",
            "init_args": {"arch": "logistic", "optimizer": "sgd", "lr": 0.05, "momentum": 0.0, **(model or {})},
        },
        "data": {
            "class_path": "datamodules.ClinicalTableFederated",
            "init_args": {"root": str(root), "categorical_columns": ["cp"], "test_fraction": 0.25, "batch_size": 8},
        },
        "trainer": {"accelerator": "cpu", "devices": 1},
    }
    for section, values in overlay.items():
        config[section] = {**config.get(section, {}), **values}
    path = tmp_path / f"{run_name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return [
        "--config", str(path), "--trainer.logger=false", "--federation.plots=false", "--federation.checkpoint_every=0",
        "--federation.quiet=true", f"--federation.output_dir={tmp_path / 'runs'}", f"--federation.run_name={run_name}",
    ]  # fmt: skip
