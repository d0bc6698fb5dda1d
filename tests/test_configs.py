"""Every shipped config runs through train.py's main() for one round on tiny data and writes its run directory."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from fl_lightning.cli import main

CONFIGS = sorted(Path("configs").glob("*.yaml"))
TINY = [
    "--trainer.logger=false",
    "--federation.rounds=1",
    "--federation.progress=false",
    "--data.max_samples_per_client=30",
    "--data.image_size=8",
    "--model.width=4",
]


def test_there_are_configs():
    assert {"fedavg_digits.yaml", "fedprox_digits.yaml", "fedbn_digits.yaml"} <= {p.name for p in CONFIGS}


def fake_medmnist(path: Path) -> Path:
    """A small RGB MedMNIST-format file standing in for a user's download."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 120), ("val", 20), ("test", 40)):
        arrays[f"{split}_images"] = rng.integers(0, 255, (n, 28, 28, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 4, (n, 1))
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_runs_one_round(config, tmp_path):
    extra = []
    if "MedMNIST" in config.read_text():
        extra = [f"--data.path={fake_medmnist(tmp_path / 'fake.npz')}", "--data.image_size=8"]
    summary = main(
        ["--config", str(config), *TINY, *extra, f"--federation.output_dir={tmp_path}", "--federation.run_name=r"]
    )
    run = tmp_path / "r"
    assert json.loads((run / "summary.json").read_text()) == summary
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["federation"]["rounds"] == 1 and resolved["data"]["init_args"]["image_size"] == 8
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    num_clients = resolved["data"]["init_args"]["num_clients"]
    assert len(rows) == num_clients and {r["client"] for r in rows} == set(summary["clients"])
    stats = next(iter(summary["summary"].values()))["acc"]
    assert 0.0 <= stats["worst"] <= stats["mean"] <= 1.0 and stats["std"] >= 0
