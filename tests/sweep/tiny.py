"""Tiny sweeps for the tests: runs of two or three rounds on 8×8 digits that take about a second each."""

from __future__ import annotations

from pathlib import Path

import yaml

TINY = ["--trainer.logger=false", "--federation.rounds=2", "--federation.plots=false",
        "--data.max_samples_per_client=40", "--data.image_size=8", "--model.width=4"]  # fmt: skip
FEDPROX = "configs/fedprox_digits.yaml"


def write_space(path: Path, space: dict) -> Path:
    """Write a space file; its path."""
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


SPACE = {
    "data.init_args.val_fraction": 0.25,
    "model.init_args.lr": {"type": "categorical", "choices": [0.05, 0.1, 0.2]},
    "trainer.callbacks[FedProx].mu": {"type": "log_uniform", "low": 0.001, "high": 1.0},
}
