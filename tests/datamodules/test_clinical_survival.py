"""A survival table (time and event columns, one CSV per hospital) trains a federated Cox model end to end."""

import csv

import numpy as np
import torch

from datamodules import ClinicalTableFederated
from fl_lightning.cli import main


def _survival_sites(root, sites=3, rows=80):
    """Per site: 3 numeric features, a categorical one; exponential times with risk x·β, ~30 % censored."""
    rng = np.random.default_rng(1)
    beta = np.array([1.0, -0.8, 0.5])
    for s in range(sites):
        x = rng.normal(loc=s, size=(rows, 3))
        group = rng.integers(0, 2, rows)
        risk = (x - s) @ beta + 0.7 * group
        event_time = rng.exponential(np.exp(-risk))
        censor_time = rng.exponential(2.0, rows)
        time, event = np.minimum(event_time, censor_time), (event_time <= censor_time).astype(int)
        with (root / f"site{s}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["a", "b", "c", "group", "months", "died"])
            for i in range(rows):
                writer.writerow([*(f"{v:.5f}" for v in x[i]), ["no", "yes"][group[i]], f"{time[i]:.5f}", event[i]])


def test_time_and_event_columns_give_survival_labels(tmp_path):
    _survival_sites(tmp_path)
    data = ClinicalTableFederated(tmp_path, time_column="months", event_column="died", categorical_columns=["group"])
    split = data.client_data("site0")
    assert data.label_kind == "survival" and data.num_features == 4
    assert split.train_y.dtype == torch.float32 and split.train_y.shape[1] == 2
    assert set(split.train_y[:, 1].tolist()) == {0.0, 1.0}


def test_a_federated_cox_model_on_survival_tables_beats_a_constant_predictor(tmp_path):
    _survival_sites(tmp_path)
    summary = main([
        "--model.class_path=fl_lightning.clients.SurvivalClient", "--model.init_args.optimizer=adam",
        "--model.init_args.lr=0.05", "--data.class_path=datamodules.ClinicalTableFederated",
        f"--data.init_args.root={tmp_path}", "--data.init_args.time_column=months",
        "--data.init_args.event_column=died", "--data.init_args.categorical_columns=[group]",
        "--data.init_args.test_fraction=0.3", "--federation.rounds=4", f"--federation.output_dir={tmp_path / 'runs'}",
        "--trainer.logger=false", "--federation.quiet=true", "--federation.plots=false",
    ])  # fmt: skip
    assert summary["summary"]["global"]["c_index"]["mean"] > 0.6
    assert summary["summary"]["global"]["c_index"]["worst"] > 0.5
