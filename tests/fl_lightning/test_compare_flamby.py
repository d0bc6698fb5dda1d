"""``compare --format flamby``: real runs' per-client and pooled results as rows of FLamby's result schema."""

import csv

import pytest

from fl_lightning.cli import main as train
from fl_lightning.server.cross_site import read_cross_site
from fl_lightning.tools.compare.cli import main as compare

FAST = [
    "--data.init_args.max_samples_per_client=40", "--data.init_args.image_size=8", "--data.init_args.num_clients=3",
    "--model.init_args.width=4", "--trainer.logger=false", "--federation.quiet=true", "--federation.plots=false",
]  # fmt: skip


def _run(tmp_path, name, *extra):
    return train(["--config=configs/fedavg_digits.yaml", "--federation.rounds=1", f"--federation.output_dir={tmp_path}",
                  f"--federation.run_name={name}", *FAST, *extra])  # fmt: skip


def test_flamby_rows_hold_every_client_and_the_pooled_test_of_each_run(tmp_path):
    fedavg = _run(tmp_path, "avg")
    local = _run(tmp_path, "local", "--federation.mode=local")
    out = tmp_path / "out"
    assert compare([fedavg["run_dir"], local["run_dir"], "--format", "flamby", "--out", str(out)]) == 0
    with (out / "results_flamby.csv").open() as f:
        rows = list(csv.DictReader(f))
    ids = list(fedavg["clients"])
    avg = {r["Test"]: float(r["Metric"]) for r in rows if r["Method"] == "FedAvg"}
    expected = {f"client_test_{i}": fedavg["clients"][c]["global"]["acc"] for i, c in enumerate(ids)}
    expected["Pooled Test"] = fedavg["pooled"]["acc"]
    assert avg == pytest.approx(expected, abs=1e-12)
    matrix = read_cross_site(tmp_path / "local" / "cross_site.csv")
    for i, holder in enumerate(ids):  # a local run: every client's own model, on every test set
        got = {r["Test"]: float(r["Metric"]) for r in rows if r["Method"] == f"Local {i}"}
        want = {f"client_test_{j}": matrix[holder][c]["acc"] for j, c in enumerate(ids)}
        want["Pooled Test"] = matrix[holder]["pooled"]["acc"]
        assert got == pytest.approx(want, abs=1e-12)
    assert {r["seed"] for r in rows} == {"0"} and {r["metric_name"] for r in rows} == {"acc"}


def test_flamby_format_refuses_a_metric_the_runs_lack(tmp_path, capsys):
    run = _run(tmp_path, "avg")
    assert compare([run["run_dir"], "--format", "flamby", "--metric", "dice", "--out", str(tmp_path / "o")]) == 2
    assert "holds no global 'dice'" in capsys.readouterr().err
