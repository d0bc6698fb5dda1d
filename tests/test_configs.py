"""Every shipped config runs through train.py's main() for two rounds on tiny data, on both transports."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from fl_lightning.cli import main
from tests.anchors.runs import describe

CONFIGS = sorted(Path("configs").glob("*.yaml"))
TINY = [
    "--trainer.logger=false",
    "--federation.rounds=2",
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


def metrics_without_timings(path: Path) -> list[dict[str, str]]:
    return [
        {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}
        for row in csv.DictReader(path.open())
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_runs_and_both_transports_agree(config, tmp_path):
    """Two rounds through train.py's main, in process and serialized: bit-identical states, same metrics and summary."""
    extra = []
    if "MedMNIST" in config.read_text():
        extra = [f"--data.path={fake_medmnist(tmp_path / 'fake.npz')}", "--data.image_size=8"]
    summaries = {}
    for transport in ("inprocess", "serialized"):
        args = ["--config", str(config), *TINY, *extra, f"--federation.output_dir={tmp_path}",
                f"--federation.run_name={transport}",
                f"--federation.transport={transport}"]  # fmt: skip
        summaries[transport] = main(args)
    run = tmp_path / "inprocess"
    summary = summaries["inprocess"]
    assert json.loads((run / "summary.json").read_text()) == summary
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["federation"]["rounds"] == 2 and resolved["data"]["init_args"]["image_size"] == 8
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    num_clients = resolved["data"]["init_args"]["num_clients"]
    assert len(rows) == 2 * num_clients and {r["client"] for r in rows} == set(summary["clients"])
    stats = next(iter(summary["summary"].values()))["acc"]
    assert 0.0 <= stats["worst"] <= stats["mean"] <= 1.0 and stats["std"] >= 0
    # the serialized transport: only messages crossed, and nothing changed
    other = tmp_path / "serialized"
    assert describe(other)["sha256"] == describe(run)["sha256"]
    assert metrics_without_timings(other / "metrics.csv") == metrics_without_timings(run / "metrics.csv")
    strip = lambda s: {k: v for k, v in s.items() if k != "run_dir"}  # noqa: E731
    assert strip(summaries["serialized"]) == strip(summary)
