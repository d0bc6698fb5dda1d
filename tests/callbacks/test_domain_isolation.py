"""Deep Domain Isolation + sample-clustered FL on the tiny inverted-digits segmentation task."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from callbacks import DomainIsolation, FederatedCallback
from callbacks.ddi.cluster_selector import predict_clusters
from datamodules import DigitsSegFederated
from fl_lightning.clients.segmentation import SegmentationClient
from fl_lightning.clients.segmentation_metrics import pixel_confusion, segmentation_metrics
from fl_lightning.outputs.checkpoint import checkpoint_path
from tests.conftest import build_federation

SELECTOR = {"selector_rounds": 2, "selector_local_steps": 2, "selector_lr": 0.05}


def inverted_digits(partition: str = "iid", num_clients: int = 3, num_samples: int = 90, size: int = 12):
    """Digit segmentation where about half the images of every client are intensity-inverted (domain 1)."""
    return DigitsSegFederated(
        num_clients=num_clients, image_size=size, num_samples=num_samples, inverted_fraction=0.5,
        partition=partition, alpha=0.25, site_styles=False, batch_size=8, seed=0,
    )  # fmt: skip


def seg_model(data: DigitsSegFederated, width: int = 4) -> SegmentationClient:
    torch.manual_seed(0)
    return SegmentationClient(
        num_classes=data.num_classes, in_channels=1, image_size=data.image_size, width=width, norm="instance", lr=3e-3
    )


class Uploads(FederatedCallback):
    """Records each upload and checks every group's aggregate against a hand-computed weighted mean."""

    def __init__(self) -> None:
        self.uploads: dict[int, dict[str, list]] = {}
        self.round, self.checked = 0, 0

    def on_round_start(self, federation, round_idx, selected):
        self.round = round_idx

    def on_reply(self, server, task, reply, weight):
        self.uploads.setdefault(self.round, {}).setdefault(reply.group, []).append((reply, weight))

    def on_aggregate(self, federation, group, previous, averaged):
        ups = [u for u, _ in self.uploads[self.round][group.name]]
        sizes = torch.tensor([float(u.num_samples) for u in ups])
        if group.subsets is not None:  # n_{i,m}: the client's samples of this cluster
            assert [u.num_samples for u in ups] == [len(group.subsets[u.client_id]) for u in ups]
        weights = [w for _, w in self.uploads[self.round][group.name]]
        assert torch.allclose(torch.tensor(weights), sizes / sizes.sum())
        key = "net.head.weight" if "net.head.weight" in averaged else next(k for k in averaged if "weight" in k)
        by_hand = sum(u.state[key] * (n / sizes.sum()) for u, n in zip(ups, sizes))
        assert torch.allclose(averaged[key], by_hand, atol=1e-6)
        self.checked += 1
        return averaged


def run_ddi(tmp_path, rounds=3, split_round=2, extra=(), **kwargs):
    data = inverted_digits()
    ddi = DomainIsolation(split_round=split_round, **SELECTOR, **kwargs)
    fed = build_federation(
        tmp_path, [ddi, *extra], data=data, model=seg_model(data), rounds=rounds, plots=True, run_name="r",
        keep_checkpoints=0,
    )  # fmt: skip
    return fed, ddi, fed.run()


def test_pipeline_clusters_every_sample_and_reports(tmp_path):
    spy = Uploads()
    fed, ddi, summary = run_ddi(tmp_path, extra=[spy])
    data = fed.data
    # one sample-level group per cluster, all starting from the split-round model; a partition of all samples
    assert [g.name for g in fed.groups] == ["global.0", "global.1"]
    for cid in data.client_ids:
        n = data.num_train_samples(cid)
        assert len(ddi.clusters[cid]) == n
        owned = torch.cat([g.subsets[cid] for g in fed.groups if cid in g.members])
        assert torch.equal(owned.sort().values, torch.arange(n))
        for m, name in ddi.group_names.items():
            group = next(g for g in fed.groups if g.name == name)
            assert torch.equal(
                group.subsets.get(cid, torch.zeros(0, dtype=torch.int64)), (ddi.clusters[cid] == m).nonzero().flatten()
            )
    assert spy.checked == 2 + 2  # one group in rounds 1-2, two in round 3; weights n_{i,m}/n_m
    # clustering quality against the true domain, in summary.json and rounds.csv
    info = summary["domain_isolation"]
    assert info["split"] and sum(info["cluster_sizes"]) == sum(data.num_train_samples(c) for c in data.client_ids)
    assert info["rand_index"] >= 0.95 and info["adjusted_rand_index"] >= 0.9
    rows = list(csv.DictReader((fed.run_dir.path / "rounds.csv").open()))
    assert float(rows[1]["ddi/rand_index"]) == info["rand_index"] and rows[0]["ddi/rand_index"] == ""
    # routed models, summarised like global, per client in summary.json
    assert {"selector", "oracle"} <= set(summary["summary"])
    for model in ("selector", "oracle"):
        assert set(summary["summary"][model]) >= {"dice", "miou"}
        assert all(model in summary["clients"][c] for c in data.client_ids)
    assert (fed.run_dir.path / "ddi_gradients.png").stat().st_size > 0
    assert json.loads((fed.run_dir.path / "selector" / "summary.json").read_text())["methods"] == ["Scaffold"]


def test_routed_evaluation_equals_evaluating_by_hand(tmp_path):
    fed, ddi, summary = run_ddi(tmp_path)
    module, data = fed.module, fed.data
    groups = {g.name: g for g in fed.groups}
    for cid in data.client_ids:
        split = data.client_data(cid)
        routes = {
            "selector": predict_clusters(ddi.selector, split.test_x, torch.device("cpu")),
            "oracle": torch.tensor([ddi.oracle[int(d)] for d in split.test_domain]),
        }
        for name, route in routes.items():
            preds = torch.empty_like(split.test_y)
            for j in range(len(split.test_x)):  # one image at a time, each through its cluster's model
                module.load_state_dict(groups[ddi.group_names[int(route[j])]].state)
                module.eval()
                with torch.no_grad():
                    preds[j] = module(split.test_x[j : j + 1]).argmax(1)[0]
            by_hand = segmentation_metrics(pixel_confusion(preds, split.test_y, data.num_classes))
            got = summary["clients"][cid][name]
            assert got["dice"] == pytest.approx(by_hand["dice"], abs=1e-6)
            assert got["acc"] == pytest.approx(by_hand["acc"], abs=1e-6)


def test_resume_after_the_split_is_exact(tmp_path):
    fed_a, ddi_a, summary_a = run_ddi(tmp_path / "a", rounds=4, split_round=2)
    assert checkpoint_path(fed_a.run_dir.path, 2).exists()
    # a fresh process state: new data, model and callback objects, resumed from the checkpoint after the split
    data = inverted_digits()
    ddi_b = DomainIsolation(split_round=2, **SELECTOR)
    fed_b = build_federation(
        tmp_path / "b", [ddi_b], data=data, model=seg_model(data), rounds=4, plots=True,
        resume=str(checkpoint_path(fed_a.run_dir.path, 2)),
    )  # fmt: skip
    summary_b = fed_b.run()
    assert [g.name for g in fed_b.groups] == [g.name for g in fed_a.groups]
    for ga, gb in zip(fed_a.groups, fed_b.groups):
        assert all(torch.equal(ga.state[k], gb.state[k]) for k in ga.state)
        assert all(torch.equal(ga.subsets[c], gb.subsets[c]) for c in ga.subsets)
    assert all(torch.equal(ddi_a.clusters[c], ddi_b.clusters[c]) for c in ddi_a.clusters)
    for model in ("global", "selector", "oracle"):
        assert summary_b["summary"][model]["dice"]["mean"] == summary_a["summary"][model]["dice"]["mean"]


def test_split_round_after_the_last_round_is_plain_fedavg(tmp_path):
    fed, ddi, summary = run_ddi(tmp_path, rounds=1, split_round=5)
    assert len(fed.groups) == 1 and fed.groups[0].subsets is None and ddi.clusters is None
    assert summary["domain_isolation"] == {"split": False} and "selector" not in summary["summary"]


@pytest.mark.slow
@pytest.mark.parametrize("partition", ["iid", "domain", "dirichlet_domain"])
@pytest.mark.parametrize("prune_fraction", [None, 0.01])
def test_rand_index_against_the_true_domain(tmp_path, partition, prune_fraction):
    data = inverted_digits(partition, num_clients=10, num_samples=400, size=16)
    ddi = DomainIsolation(split_round=3, prune_fraction=prune_fraction, **SELECTOR)
    fed = build_federation(tmp_path, [ddi], data=data, model=seg_model(data, width=16), rounds=3, eval_every=0)
    summary = fed.run()
    assert summary["domain_isolation"]["rand_index"] >= 0.95
