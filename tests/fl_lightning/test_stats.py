"""Federated statistics (``mode: stats``, ``python -m fl_lightning.stats``): equal to numpy on the pooled data,
small cells and small sites withheld, noise at the site, a failing site left out, the same over messages."""

import json
import math

import numpy as np
import pytest
import torch

from fl_lightning import stats as stats_command
from fl_lightning.runtime import site_stats
from fl_lightning.server import statistics
from tests.callbacks.tables import table_args
from tests.conftest import build_federation, tiny_data

BINS = 16


def _run(tmp_path, data=None, **config):
    cfg = {"mode": "stats", "stats_min_count": 1, "stats_bins": BINS, "run_name": "s", **config}
    return build_federation(tmp_path, data=data, **cfg).run()


def _pooled(data, split):
    xs = [getattr(data.client_data(c), f"{split}_x") for c in data.client_ids]
    ys = [getattr(data.client_data(c), f"{split}_y") for c in data.client_ids]
    return torch.cat(xs).double().numpy(), torch.cat(ys).numpy()


def test_pooled_statistics_equal_numpy_on_the_pooled_data(tmp_path):
    data = tiny_data()
    rep = _run(tmp_path, data, plots=True)
    for split in ("train", "test"):
        x, y = _pooled(data, split)
        got = rep["pooled"][split]
        assert got["n"] == len(y) and got["sites"] == 3
        counts = np.bincount(y, minlength=data.num_classes)
        assert got["labels"] == counts.tolist()
        np.testing.assert_allclose(got["prevalence"], counts / counts.sum(), rtol=1e-12)
        hist, _ = np.histogram(x.reshape(-1), bins=BINS, range=(0.0, 1.0))
        assert got["histogram"] == hist.tolist()
        per_channel = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1)
        np.testing.assert_allclose(got["mean"], per_channel.mean(1), rtol=1e-10)
        np.testing.assert_allclose(got["std"], per_channel.std(1), rtol=1e-8)
    site = rep["sites"]["site1"]["statistics"]["train"]
    assert site["n"] == data.num_train_samples("site1")
    assert site["labels"] == data.label_counts("site1").tolist()
    on_disk = json.loads((tmp_path / "s" / "stats.json").read_text())
    assert on_disk["pooled"]["train"]["labels"] == rep["pooled"]["train"]["labels"]
    assert (tmp_path / "s" / "stats.png").is_file()


def test_a_site_smaller_than_min_count_is_withheld_and_left_out_of_the_pool(tmp_path):
    data = tiny_data(max_samples_per_client=40)
    sizes = {c: data.num_train_samples(c) for c in data.client_ids}
    floor = max(sizes.values()) + 1
    rep = _run(tmp_path, data, stats_min_count=floor)
    for cid in data.client_ids:
        assert rep["sites"][cid]["released"]["train"] == {"withheld": f"fewer than min_count={floor} samples"}
    assert rep["pooled"]["train"] == {"sites": 0, "sites_withheld": 3}


def test_small_label_cells_are_withheld_and_counted():
    summary = {"n": 30, "cases": 4, "labels": [20, 3, 0, 7], "histogram": [25, 5], "sum": [1.0], "sumsq": [1.0],
               "values": 30, "shape": [1, 1, 1]}  # fmt: skip
    out = site_stats.release(summary, min_count=5, sigma=None, sample_kind="image")
    assert out["labels"] == [20, None, 0, 7]  # a zero is no disclosure; 3 patients is
    assert out["cases"] is None and out["histogram"] == [25, 5]
    derived = statistics.derive([out, {**summary, "labels": [1, 1, 1, 1], "n": 4, "withheld": "small"}])
    assert derived["labels"] == [20, None, 0, 7] and derived["label_cells_withheld"] == 1
    assert derived["prevalence"] == [20 / 27, None, 0, 7 / 27]
    other = {**summary, "labels": [5, 6, 1, 0]}
    pooled = statistics.derive([out, site_stats.release(other, min_count=5, sigma=None, sample_kind="image")])
    assert pooled["labels"] == [25, 6, 0, 7] and pooled["label_cells_withheld"] == 2  # a cell one site released
    assert derived["sites"] == 1 and derived["sites_withheld"] == 1


def test_noise_is_the_gaussian_mechanism_at_the_site_and_not_seeded_by_the_run(tmp_path):
    data = tiny_data()
    exact = _run(tmp_path / "exact", data)
    first = _run(tmp_path / "a", data, stats_epsilon=2.0, stats_delta=1e-5)
    second = _run(tmp_path / "b", data, stats_epsilon=2.0, stats_delta=1e-5)
    released = first["sites"]["site0"]["released"]["train"]
    channels, pixels = released["shape"][0], math.prod(released["shape"][1:])
    z = site_stats.noise_multiplier(2.0, 1e-5) * math.sqrt(5)  # five groups: n, labels, histogram, sum, sumsq
    expected = {"n": z, "labels": z, "histogram": z * channels * pixels, "sum": z * math.sqrt(channels) * pixels,
                "sumsq": z * math.sqrt(channels) * pixels}  # fmt: skip
    assert released["noise_std"] == pytest.approx(expected)
    assert released["n"] != exact["sites"]["site0"]["released"]["train"]["n"]
    assert released["n"] != second["sites"]["site0"]["released"]["train"]["n"]  # fresh noise, same run seed
    assert 0.5 < site_stats.noise_multiplier(2.0, 1e-5) < 3  # the PRV calibration of one Gaussian release


def test_tables_give_column_means_and_quartiles_and_withhold_them_under_noise(tmp_path):
    from fl_lightning.cli import main

    rep = main([*table_args(tmp_path, "t"), "--federation.mode=stats", "--federation.stats_min_count=1"])
    site = rep["sites"]["site0"]["statistics"]["train"]
    assert len(site["mean"]) == len(site["std"]) == len(site["quantiles"]["0.5"])
    assert rep["pooled"]["train"]["n"] == sum(s["statistics"]["train"]["n"] for s in rep["sites"].values())
    noisy = main([*table_args(tmp_path, "tn"), "--federation.mode=stats", "--federation.stats_epsilon=1.0"])
    released = noisy["sites"]["site0"]["released"]["train"]
    assert released["sum"] is None and released["quantiles"] is None and "unbounded" in released["withheld_columns"]


def test_a_site_that_raises_is_recorded_and_the_others_still_answer(tmp_path, monkeypatch):
    real = site_stats.site_statistics

    def broken(data, client_id, options):
        if client_id == "site1":
            raise ValueError("unreadable scan")
        return real(data, client_id, options)

    monkeypatch.setattr(site_stats, "site_statistics", broken)
    with pytest.warns(UserWarning, match="'site1' failed and is left out of the statistics"):
        rep = _run(tmp_path)
    assert rep["failed"] == {"site1": "ValueError: unreadable scan"}
    assert set(rep["sites"]) == {"site0", "site2"}
    assert "failed: ValueError: unreadable scan" in statistics.table_text(rep)


def test_the_serialized_transport_gives_the_same_statistics(tmp_path):
    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b", transport="serialized")
    assert a == b


def test_the_command_prints_the_table_and_writes_stats_json(tmp_path, capsys):
    rep = stats_command.main([
        "--config", "configs/fedavg_digits.yaml", "--data.init_args.max_samples_per_client=30",
        "--trainer.logger=false", f"--federation.output_dir={tmp_path}", "--federation.run_name=cmd",
        "--federation.stats_min_count=25",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "pooled" in out and "min_count=25" in out
    on_disk = json.loads((tmp_path / "cmd" / "stats.json").read_text())
    assert on_disk["rules"]["min_count"] == 25 == rep["rules"]["min_count"]
    assert all("withheld" in s["released"]["test"] for s in on_disk["sites"].values())  # 6 test images a site


def test_a_site_applies_the_stricter_of_the_servers_rules_and_its_own():
    server = {"secure": False, "min_count": 3, "bins": 16, "epsilon": None, "delta": 1e-5}
    assert site_stats.strictest(server, server) == server
    own = {"secure": True, "min_count": 20, "bins": 4, "epsilon": 2.0, "delta": 1e-6}
    assert site_stats.strictest(server, own) == {"secure": True, "min_count": 20, "bins": 16, "epsilon": 2.0,
                                                 "delta": 1e-6}  # fmt: skip
    assert site_stats.strictest({**server, "secure": True}, {**own, "secure": False})["secure"]
    assert site_stats.strictest({**server, "epsilon": 0.5}, own)["epsilon"] == 0.5  # the smaller ε wins
    assert site_stats.strictest({**server, "min_count": 50}, own)["min_count"] == 50


def test_a_coordinator_cannot_lower_a_sites_own_floor(tmp_path):
    """The server asks min_count=1; the site's own config says 30 (in a deployment: its fl-args): 30 holds, and
    stats.json says which site applied which rules."""
    from dataclasses import replace

    fed = build_federation(tmp_path, mode="stats", stats_min_count=1, stats_bins=BINS, run_name="s")
    runtime = fed.transport.runtime
    runtime.config = replace(runtime.config, stats_min_count=30)  # the site's own settings, not the server's
    rep = fed.run()
    assert rep["rules"]["min_count"] == 1
    assert {c: r["min_count"] for c, r in rep["site_rules"].items()} == dict.fromkeys(fed.data.client_ids, 30)
    assert all("withheld" in s["released"]["test"] for s in rep["sites"].values())  # fewer than 30 test samples
    assert "applied its own stricter rules: min_count=30" in statistics.table_text(rep)
