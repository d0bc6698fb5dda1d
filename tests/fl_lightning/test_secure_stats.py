"""Secure federated statistics (``federation.stats_secure``) and a table's missing cells: the pooled sums equal
numpy and the clear run, one site's upload alone is random, a dropped site is re-masked out, small pooled cells are
withheld, a site that asks for secrecy refuses the clear; missing cells counted before rows are dropped."""

import csv
import math

import numpy as np
import pytest
import torch

from callbacks import SecureAggregation
from fl_lightning.ops import secagg, stats_vector
from fl_lightning.runtime import site_stats
from fl_lightning.runtime.secure_stats import SecureStatsSite
from fl_lightning.server import statistics
from tests.callbacks.tables import SITES, table_args, write_table
from tests.conftest import build_federation, tiny_data

BINS = 16


def _run(tmp_path, data=None, callbacks=(), **config):
    cfg = {"mode": "stats", "stats_min_count": 1, "stats_bins": BINS, "run_name": "s", **config}
    return build_federation(tmp_path, callbacks, data=data, **cfg).run()


def test_the_secure_sum_gives_the_clear_pooled_statistics_and_nothing_of_one_site(tmp_path):
    data = tiny_data()
    clear = _run(tmp_path / "clear", data)
    secure = _run(tmp_path / "secure", data, stats_secure=True)
    for split in ("train", "test"):
        a, b = clear["pooled"][split], secure["pooled"][split]
        assert (b["n"], b["labels"], b["histogram"], b["sites"]) == (a["n"], a["labels"], a["histogram"], 3)
        x = torch.cat([getattr(data.client_data(c), f"{split}_x") for c in data.client_ids]).double().numpy()
        per_channel = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1)
        # the fixed point's error: 2^-17 per entry and site, on sums over ~10^4 values
        np.testing.assert_allclose(b["mean"], per_channel.mean(1), atol=1e-8)
        np.testing.assert_allclose(b["std"], per_channel.std(1), atol=1e-7)
    for site in secure["sites"].values():  # flags only: no count, label or sum of a site reached the server
        assert site["statistics"] == {} and site["released"]["train"] == {"released": True, "cases": False,
                                                                          "sums": True}  # fmt: skip
    assert secure["secure"]["sites"] == sorted(data.client_ids)
    assert "masked" in statistics.table_text(secure) and "secure sum over" in statistics.table_text(secure)


def test_one_upload_alone_is_masked_and_all_uploads_sum_to_the_sites_vectors():
    data, rules = tiny_data(), {"min_count": 1, "bins": BINS, "epsilon": None, "delta": 1e-5, "secure": True}
    sites = {c: SecureStatsSite() for c in data.client_ids}
    keys = {c: s.answer(data, c, {"phase": "keys"}, rules) for c, s in sites.items()}
    spec = keys["site0"]["layout"]
    peers = {c: k["public_key"] for c, k in keys.items()}
    task = {"phase": "sum", "peers": peers, "session": "t", "layout": spec}
    uploads = {c: s.answer(data, c, task, rules)["masked"] for c, s in sites.items()}
    vectors = {c: site_stats.secure_parts(data, c, rules)[1] for c in sites}
    for c in sites:  # a site's upload alone decodes to noise, not to its vector
        assert not torch.allclose(secagg.unmasked_sum([uploads[c]], stats_vector.STATS_BITS), vectors[c])
    total = secagg.unmasked_sum(uploads.values(), stats_vector.STATS_BITS)
    torch.testing.assert_close(total, sum(vectors.values()), atol=3 * 2.0**-17, rtol=0)
    with pytest.raises(ValueError, match="already sent its statistics of this session"):
        sites["site0"].answer(data, "site0", task, rules)  # a second, fresh-noise release is refused
    with pytest.raises(ValueError, match="refuses to re-mask"):  # not one of the peers it masked with
        sites["site0"].answer(data, "site0", {"phase": "remask", "before": {"site0": peers["site0"]},
                                               "after": {"site0": peers["site0"]}, "session": "t"}, rules)  # fmt: skip


def test_a_site_that_drops_before_its_upload_is_masked_out_and_the_others_pool(tmp_path, monkeypatch):
    real = SecureStatsSite.answer

    def dropping(self, data, client_id, options, rules):
        if client_id == "site1" and options["phase"] == "sum":
            raise ConnectionError("site lost its network")
        return real(self, data, client_id, options, rules)

    monkeypatch.setattr(SecureStatsSite, "answer", dropping)
    data = tiny_data()
    with pytest.warns(UserWarning, match=r"\['site1'\] sent no upload"):
        rep = _run(tmp_path, data, stats_secure=True)
    assert set(rep["failed"]) == {"site1"} and "site lost its network" in rep["failed"]["site1"]
    for split in ("train", "test"):
        ys = [getattr(data.client_data(c), f"{split}_y") for c in ("site0", "site2")]
        counts = np.bincount(torch.cat(ys).numpy(), minlength=data.num_classes)
        assert rep["pooled"][split]["labels"] == counts.tolist() and rep["pooled"][split]["sites"] == 2


def test_fewer_than_two_sites_cannot_be_summed_securely(tmp_path, monkeypatch):
    real = SecureStatsSite.answer

    def only_one(self, data, client_id, options, rules):
        if client_id != "site0":
            raise ValueError("unreadable scan")
        return real(self, data, client_id, options, rules)

    monkeypatch.setattr(SecureStatsSite, "answer", only_one)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=r"two sites or more .* only \['site0'\]"):
        _run(tmp_path, stats_secure=True)


def test_small_pooled_cells_are_withheld_after_the_secure_sum(tmp_path):
    data = tiny_data()
    clear = _run(tmp_path / "clear", data)["pooled"]["train"]["labels"]
    floor = sorted(clear)[len(clear) // 2]  # half the pooled cells fall under it
    rep = _run(tmp_path / "secure", data, stats_secure=True, stats_min_count=floor)
    assert rep["pooled"]["train"]["labels"] == [None if 0 < c < floor else c for c in clear]
    assert rep["pooled"]["train"]["label_cells_withheld"] == sum(0 < c < floor for c in clear) > 0


def test_a_secure_aggregation_run_sums_its_statistics_securely_unless_told(tmp_path):
    assert "secure" in _run(tmp_path / "a", callbacks=[SecureAggregation()])
    assert "secure" not in _run(tmp_path / "b", callbacks=[SecureAggregation()], stats_secure=False)


def test_a_site_that_asks_for_a_secure_sum_refuses_the_clear(tmp_path):
    from dataclasses import replace

    fed = build_federation(tmp_path, mode="stats", stats_min_count=1, run_name="s")
    fed.transport.runtime.config = replace(fed.transport.runtime.config, stats_secure=True)  # the sites' own
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="no client answered"):
        fed.run()
    fed = build_federation(tmp_path, mode="stats", stats_min_count=1, run_name="s2")
    fed.transport.runtime.config = replace(fed.transport.runtime.config, stats_secure=True)
    runtime = fed.transport.runtime
    from fl_lightning.wire.protocol import Task

    reply = runtime.handle(Task("stats", 0, "site0", options=fed.config.stats_rules()))
    assert "releases its statistics only in a secure sum" in reply.error


def test_noise_hides_the_exact_count_in_the_values_too(tmp_path):
    rep = _run(tmp_path, stats_epsilon=2.0)
    released = rep["sites"]["site0"]["released"]["train"]
    pixels = math.prod(released["shape"][1:])
    assert released["values"] == pytest.approx(released["n"] * pixels)  # from the noisy n, not the exact one


def _table_with_gaps(root):
    """The tiny table with missing cells: site0 has 3 in ``bp`` and 1 in ``cp``, site2 has 12 in ``age``."""
    write_table(root)
    gaps = {"site0": {"bp": [1, 4, 9], "cp": [2]}, "site2": {"age": list(range(12))}}
    for site, columns in gaps.items():
        path = root / f"{site}.csv"
        rows = list(csv.reader(path.open()))
        header = rows[0]
        for column, lines in columns.items():
            for i in lines:
                rows[1 + i][header.index(column)] = "?" if i % 2 else ""
        with path.open("w", newline="") as f:
            csv.writer(f).writerows(rows)
    return gaps


def test_a_tables_missing_cells_are_counted_per_column_before_rows_are_dropped(tmp_path):
    from fl_lightning.cli import main

    gaps = _table_with_gaps(tmp_path / "table")
    args = table_args(tmp_path, "t")
    rep = main([*args, "--federation.mode=stats", "--federation.stats_min_count=1",
                "--data.init_args.missing=drop"])  # fmt: skip
    for site in SITES:
        missing = rep["sites"][site]["statistics"]["missing"]
        expected = {c: len(gaps.get(site, {}).get(c, [])) for c in missing["columns"]}
        assert missing["rows"] == 40 and dict(zip(missing["columns"], missing["missing"])) == expected
    pooled = rep["pooled"]["missing"]
    assert pooled["rows"] == 120 and dict(zip(pooled["columns"], pooled["missing"]))["age"] == 12
    assert pooled["share"][pooled["columns"].index("bp")] == pytest.approx(3 / 120)
    assert "missing cells: age 12" in statistics.table_text(rep)
    # 3 cells in bp at site0 are under min_count=5 and withheld; site2's 12 in age are not
    small = main([*table_args(tmp_path, "t5"), "--federation.mode=stats", "--federation.stats_min_count=5",
                  "--data.init_args.missing=drop"])  # fmt: skip
    site0 = small["sites"]["site0"]["statistics"]["missing"]
    assert dict(zip(site0["columns"], site0["missing"]))["bp"] is None and site0["cells_withheld"] == 2
    secure = main([*table_args(tmp_path, "ts"), "--federation.mode=stats", "--federation.stats_min_count=1",
                   "--data.init_args.missing=drop", "--federation.stats_secure=true"])  # fmt: skip
    assert secure["pooled"]["missing"]["missing"] == pooled["missing"]
    assert secure["pooled"]["train"]["n"] == rep["pooled"]["train"]["n"]
