"""CFL in the Federation: different populations split into exactly those groups, identical clients never."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import ClusteredFL
from datamodules import SeededEpochSampler
from tests.conftest import build_federation, tiny_data


def swap_labels(data, client_ids):
    """Give some clients the permuted labeling 9 − y: a clearly different population (conflicting updates)."""
    for cid in client_ids:
        split = data.client_data(cid)
        split.train_y.copy_(9 - split.train_y)
        split.test_y.copy_(9 - split.test_y)
    return data


def copy_client(data, source):
    """Identical clients: every client has the source client's data and draws the same batches."""
    ref = data.client_data(source)
    for cid in data.client_ids:
        split = data.client_data(cid)
        for name in ("train_x", "train_y", "test_x", "test_y"):
            setattr(split, name, getattr(ref, name).clone())
    calls = {}

    def same_batches(client_id, steps=None):
        calls[client_id] = calls.get(client_id, 0) + 1  # the n-th fit of every client sees the same order
        # the project's own sampler: torch's RandomSampler with a generator is re-seeded by Lightning after
        # the first fit, so it cannot give two fits the same order
        sampler = SeededEpochSampler(len(ref.train_y), seed=calls[client_id])
        return DataLoader(TensorDataset(ref.train_x, ref.train_y), batch_size=data.batch_size, sampler=sampler)

    data.client_train_loader = same_batches
    return data


def test_two_populations_are_split_into_exactly_those_groups(tmp_path):
    data = swap_labels(tiny_data(num_clients=4, site_styles=False), ["site2", "site3"])
    cfl = ClusteredFL(split_round=2)
    fed = build_federation(tmp_path, [cfl], data=data, rounds=3, local_epochs=2)
    summary = fed.run()
    assert sorted(sorted(g.members) for g in fed.groups) == [["site0", "site1"], ["site2", "site3"]]
    assert cfl.splits and cfl.splits[0]["round"] == 2
    # each client is evaluated with its cluster's model, and there is no single pooled model any more
    assert "pooled" not in summary and set(summary["clients"]) == set(data.client_ids)
    a, b = fed.groups
    assert not torch.equal(a.state["net.classifier.weight"], b.state["net.classifier.weight"])


def test_identical_clients_are_never_split(tmp_path):
    data = copy_client(tiny_data(num_clients=3, site_styles=False), "site0")
    for cfl in (ClusteredFL(split_round=1), ClusteredFL(eps1=1e9, eps2=0.0)):  # forced, and criterion always met
        fed = build_federation(tmp_path / str(id(cfl)), [cfl], data=data, rounds=2)
        fed.run()
        assert len(fed.groups) == 1 and not cfl.splits


def test_criterion_triggers_a_split_and_resume_keeps_the_clusters(tmp_path):
    data = swap_labels(tiny_data(num_clients=4, site_styles=False), ["site2", "site3"])
    fed = build_federation(tmp_path, [ClusteredFL(eps1=1e9, eps2=0.0)], data=data, rounds=2, run_name="r")
    fed.run()
    assert len(fed.groups) >= 2
    resumed = build_federation(
        tmp_path, [ClusteredFL(eps1=1e9, eps2=0.0)], data=data, rounds=2, run_name="r", resume="last"
    )
    resumed.run()
    assert [g.members for g in resumed.groups] == [g.members for g in fed.groups]
