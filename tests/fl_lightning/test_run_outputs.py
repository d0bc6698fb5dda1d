"""What a run leaves behind: plots, environment record, timings, the evaluation protocol and the final table."""

import csv
import io
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from stat import S_IMODE

import lightning
import matplotlib.image
import matplotlib.pyplot
import pytest
import torch
from rich.console import Console

from callbacks import FedBN, FederatedCallback
from fl_lightning.cli import main
from fl_lightning.outputs.report import evaluation_table
from fl_lightning.server.evaluation import summarise
from tests.conftest import build_federation, tiny_data, tiny_model
from tests.test_configs import TINY

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
TIMES = ("time/train", "time/aggregate", "time/eval", "time/round", "throughput/samples_per_s")


@pytest.fixture(scope="module")
def fedavg(tmp_path_factory):
    """One FedAvg run with plots."""
    fed = build_federation(tmp_path_factory.mktemp("fedavg"), rounds=2, plots=True)
    return fed, fed.run()


@pytest.fixture(scope="module")
def fedbn(tmp_path_factory):
    fed = build_federation(tmp_path_factory.mktemp("fedbn"), callbacks=[FedBN()], rounds=2)
    return fed, fed.run()


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 0 and image.shape[1] > 0 and image.shape[2] in (3, 4)


def assert_same_metrics(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        a, e = actual[k], expected[k]
        assert (math.isnan(a) and math.isnan(e)) or a == pytest.approx(e, rel=1e-6, abs=1e-9), (k, a, e)


def evaluate_by_hand(data, state: dict, loader) -> dict:
    module = tiny_model(data)  # a separate instance: nothing of the Federation's module is reused
    module.load_state_dict(state)
    return module.evaluate(loader, CPU)


# ------------------------------------------------------------------------------------------------ plots


def test_curves_and_partition_are_pngs(fedavg):
    fed, _ = fedavg
    assert_png(fed.run_dir.path / "curves.png")
    assert_png(fed.run_dir.path / "partition.png")
    assert not list(fed.run_dir.path.glob(".*.tmp*"))  # written through a temporary file that is renamed


class Interrupt(FederatedCallback):
    """Records whether partition.png exists before the first client trains, then stops the run after round 1."""

    def __init__(self):
        self.partition_at_start = None

    def on_round_start(self, federation, round_idx, selected):
        if round_idx == 0:
            self.partition_at_start = (federation.run_dir.path / "partition.png").exists()

    def on_round_end(self, federation, round_idx, metrics):
        raise KeyboardInterrupt


def test_partition_is_written_at_the_start(tmp_path):
    probe = Interrupt()
    fed = build_federation(tmp_path, callbacks=[probe], rounds=3, plots=True, checkpoint_every=0)
    with pytest.raises(KeyboardInterrupt):
        fed.run()
    assert probe.partition_at_start is True
    assert_png(fed.run_dir.path / "partition.png")
    assert [r["round"] for r in read_csv(fed.run_dir.path / "rounds.csv")] == ["1"]


def test_no_plots_when_disabled(tmp_path):
    fed = build_federation(tmp_path, rounds=1, plots=False)
    fed.run()
    assert not list(fed.run_dir.path.glob("*.png"))


# ------------------------------------------------------------------------------------------------ environment


def test_environment_record(tmp_path):
    args = ["--config", "configs/fedavg_digits.yaml", *TINY, "--seed_everything=123", "--federation.plots=false"]
    main([*args, f"--federation.output_dir={tmp_path}", "--federation.run_name=r"])
    env = json.loads((tmp_path / "r" / "environment.json").read_text())
    assert env["python"] == platform.python_version()
    assert env["packages"]["torch"] == torch.__version__
    assert env["packages"]["lightning"] == lightning.__version__
    assert env["seed"] == 123
    commit = env["git_commit"]
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", commit), commit
    # a commit of this repository (not necessarily HEAD: commits may land while the tests run)
    sha = commit.removesuffix("-dirty")
    subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=REPO, check=True)


# ------------------------------------------------------------------------------------------------ timings


def test_round_timings(fedavg):
    fed, _ = fedavg
    rows = read_csv(fed.run_dir.path / "rounds.csv")
    assert [int(r["round"]) for r in rows] == [1, 2]
    for row in rows:
        t = {k: float(row[k]) for k in TIMES}
        assert all(v >= 0 for v in t.values()), t
        assert t["time/round"] >= t["time/train"]
        # train, aggregate and eval are disjoint parts of the round
        assert t["time/round"] >= t["time/train"] + t["time/aggregate"] + t["time/eval"] - 1e-9
        assert t["time/train"] > 0 and t["throughput/samples_per_s"] > 0


@pytest.mark.parametrize(
    ("budget", "samples_per_client"),
    [({"local_epochs": 1}, 32), ({"local_epochs": 2}, 64), ({"local_steps": 3}, 15)],
    ids=["1-epoch", "2-epochs", "3-steps"],
)
def test_throughput_counts_the_samples_trained(tmp_path, budget, samples_per_client):
    """Epochs train every sample once, also when the last batch is partial (32 % 5 != 0); steps draw full batches."""
    data = tiny_data(num_clients=3, batch_size=5)
    assert all(data.num_train_samples(c) == 32 for c in data.client_ids)
    fed = build_federation(tmp_path, data=data, rounds=1, **budget)
    fed.run()
    (row,) = read_csv(fed.run_dir.path / "rounds.csv")
    samples = float(row["throughput/samples_per_s"]) * float(row["time/train"])
    assert samples == pytest.approx(3 * samples_per_client, rel=1e-9)


# ------------------------------------------------------------------------------------------------ evaluation protocol


def test_fedbn_personal_is_the_global_model_with_the_clients_private_state(fedbn):
    fed, summary = fedbn
    evaluation = fed.last_evaluation
    global_state = fed.groups[0].state
    differs = []
    for cid in fed.data.client_ids:
        private = fed.transport.private[("global", cid)]
        assert private and set(private) < set(global_state)
        loader = fed.data.client_test_loader(cid)
        personal = evaluate_by_hand(fed.data, {**global_state, **private}, loader)
        assert_same_metrics(evaluation["clients"]["personal"][cid], personal)
        assert_same_metrics(evaluation["clients"]["global"][cid], evaluate_by_hand(fed.data, global_state, loader))
        differs.append(evaluation["clients"]["personal"][cid] != evaluation["clients"]["global"][cid])
        assert summary["clients"][cid]["personal"]["loss"] == pytest.approx(personal["loss"])
    assert any(differs)
    assert summary["summary"]["personal"] != summary["summary"]["global"]


def test_fedavg_personal_equals_global_and_pooled_is_the_global_model_on_all_test_data(fedavg):
    fed, summary = fedavg
    clients = fed.last_evaluation["clients"]
    assert set(clients["global"]) == set(clients["personal"]) == set(fed.data.client_ids)
    for cid in fed.data.client_ids:
        assert clients["personal"][cid] == clients["global"][cid]
        assert summary["clients"][cid]["personal"] == summary["clients"][cid]["global"]
    assert summary["summary"]["personal"] == summary["summary"]["global"]

    pooled = evaluate_by_hand(fed.data, fed.groups[0].state, fed.data.pooled_test_loader())
    assert_same_metrics(fed.last_evaluation["pooled"], pooled)
    assert summary["pooled_test_samples"] == sum(fed.data.num_test_samples(c) for c in fed.data.client_ids)


def test_every_client_is_evaluated_when_one_trains_per_round(tmp_path):
    data = tiny_data(num_clients=4)
    fed = build_federation(tmp_path, data=data, rounds=2, clients_per_round=1)
    summary = fed.run()
    rows = read_csv(fed.run_dir.path / "metrics.csv")
    for r in ("1", "2"):
        in_round = [row for row in rows if row["round"] == r]
        assert sum(int(row["selected"]) for row in in_round) == 1
        assert {row["client"] for row in in_round if row["global/acc"] != ""} == set(data.client_ids)
        assert {row["client"] for row in in_round if row["personal/acc"] != ""} == set(data.client_ids)
    for cid in data.client_ids:
        assert {"global", "personal"} <= set(summary["clients"][cid])
    global_state = fed.groups[0].state
    for cid in data.client_ids:
        expected = evaluate_by_hand(data, global_state, data.client_test_loader(cid))
        assert_same_metrics(fed.last_evaluation["clients"]["global"][cid], expected)


# ------------------------------------------------------------------------------------------------ summary and table


def test_summarise_by_hand():
    per_client = {
        "a": {"acc": 0.5, "loss": 0.2, "auroc": 0.9},
        "b": {"acc": 0.75, "loss": 0.4, "auroc": math.nan},  # NaN (e.g. a single-class test set) is left out
        "c": {"acc": 1.0, "loss": 0.9, "auroc": 0.7},
    }
    out = summarise(per_client)
    # acc: mean (0.5 + 0.75 + 1) / 3 = 0.75; population variance (0.0625 + 0 + 0.0625) / 3 = 1/24
    assert out["acc"]["mean"] == pytest.approx(0.75)
    assert out["acc"]["std"] == pytest.approx(math.sqrt(1 / 24))
    assert out["acc"]["worst"] == 0.5 and out["acc"]["worst_client"] == "a"
    # loss: lower is better, so the worst is the largest; mean 0.5, variance (0.09 + 0.01 + 0.16) / 3
    assert out["loss"]["mean"] == pytest.approx(0.5)
    assert out["loss"]["std"] == pytest.approx(math.sqrt(0.26 / 3))
    assert out["loss"]["worst"] == 0.9 and out["loss"]["worst_client"] == "c"
    # auroc over the two clients that have it
    assert out["auroc"]["mean"] == pytest.approx(0.8)
    assert out["auroc"]["std"] == pytest.approx(0.1)
    assert out["auroc"]["worst"] == 0.7 and out["auroc"]["worst_client"] == "c"


def render(table) -> str:
    console = Console(record=True, width=120, file=io.StringIO())  # recorded, not printed
    console.print(table)
    return console.export_text()


@pytest.mark.parametrize("run", ["fedavg", "fedbn"])
def test_final_table(run, request):
    fed, summary = request.getfixturevalue(run)
    text = render(evaluation_table(summary))
    lines = text.splitlines()
    for cid in fed.data.client_ids:
        assert any(line.split("│")[1].strip() == cid for line in lines if line.count("│") > 2), cid
    for stat in ("mean", "std", "worst"):
        row = next(line for line in lines if line.count("│") > 2 and line.split("│")[1].strip() == stat)
        for model in ("global", "personal"):
            assert f"{summary['summary'][model]['acc'][stat]:.4f}" in row, (stat, model, row)
    assert "global acc" in text and "personal acc" in text
    if "pooled" in summary:
        assert f"{summary['pooled']['acc']:.4f}" in text and "pooled test set" in text


@pytest.mark.parametrize(("seg", "unit"), [(False, "samples"), (True, "pixels")])
def test_partition_names_what_it_counts(tmp_path, monkeypatch, seg, unit):
    import fl_lightning.server.run_files as run_files
    from datamodules import DigitsSegFederated
    from fl_lightning.clients import SegmentationClient
    from fl_lightning.outputs.plots import partition_figure

    seen = {}
    monkeypatch.setattr(run_files, "plot_partition", lambda counts, path, domains, label_unit: seen.update(
        figure=partition_figure(counts, domains, label_unit)))  # fmt: skip
    if seg:
        data = DigitsSegFederated(num_clients=2, image_size=8, num_samples=40, seed=0)
        model = SegmentationClient(num_classes=data.num_classes, image_size=data.image_size, width=2, depth=1)
        fed = build_federation(tmp_path, data=data, model=model, plots=True)
    else:
        fed = build_federation(tmp_path, plots=True)
    fed.setup()
    fed._open_run_dir()
    titles = [ax.get_title() for ax in seen["figure"].axes if ax.get_title()]
    matplotlib.pyplot.close(seen["figure"])
    assert titles[0] == f"training {unit} per client, by class"
    assert all(t == "training samples per client, by site / domain" for t in titles[1:])


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_file_of_a_run_directory_gets_one_mode_from_the_umask(tmp_path, umask):
    """Failed before: CSVs, summaries and checkpoints were 0600 (from mkstemp), the figures 0644."""
    old = os.umask(umask)
    try:
        build_federation(tmp_path, run_name="r", plots=True).run()
    finally:
        os.umask(old)
    run = tmp_path / "r"
    files = [p for p in run.rglob("*") if p.is_file() and "wandb" not in p.parts]
    assert {p.suffix for p in files} >= {".csv", ".json", ".png", ".ckpt"}
    modes = {p.relative_to(run).as_posix(): oct(S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
