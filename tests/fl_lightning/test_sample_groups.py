"""Sample-level model groups: subsets, their loaders and samplers, weights n_{i,m}, and checkpoints."""

import pytest
import torch

from tests.conftest import build_federation


def split_in_two(fed):
    """Every client's even samples to part 0, odd samples to part 1."""
    fed.setup()
    ids = fed.data.client_ids
    assignments = {c: torch.arange(fed.data.num_train_samples(c)) % 2 for c in ids}
    return fed.split_samples(fed.groups[0], assignments, 2), assignments


def test_split_samples_gives_subsets_loaders_and_weights(tmp_path):
    fed = build_federation(tmp_path)
    (even, odd), _ = split_in_two(fed)
    assert [g.name for g in fed.groups] == ["global.0", "global.1"]
    assert torch.equal(even.state["net.classifier.weight"], odd.state["net.classifier.weight"])
    for cid in fed.data.client_ids:
        n = fed.data.num_train_samples(cid)
        assert torch.equal(even.subsets[cid], torch.arange(0, n, 2))
        assert fed.num_samples(cid, odd) == n // 2 and fed.num_samples(cid) == n
        split = fed.data.client_data(cid)
        sampler = fed.transport.runtime.subset_sampler(fed.fit_task(0, odd, cid))
        loader = fed.data.client_subset_train_loader(cid, odd.subsets[cid], sampler)
        seen = torch.cat([x for x, _ in loader])
        assert len(seen) == n // 2  # one epoch over exactly the subset, each sample once
        expected = split.train_x[odd.subsets[cid]].flatten(1)
        assert sorted(map(tuple, seen.flatten(1).tolist())) == sorted(map(tuple, expected.tolist()))


def test_subset_samplers_and_subsets_survive_a_checkpoint(tmp_path):
    fed = build_federation(tmp_path)
    (even, odd), _ = split_in_two(fed)
    fed.run_dir = type("Dir", (), {"client_rows": [], "round_rows": []})()  # state_dict reads the rows only
    cid = fed.data.client_ids[0]
    sampler = fed.transport.runtime.subset_sampler(fed.fit_task(0, odd, cid))
    first = list(sampler)
    state = fed.state_dict()
    after = list(sampler)
    other = build_federation(tmp_path / "b")
    other.setup()
    other.load_state_dict(state)
    assert [g.name for g in other.groups] == ["global.0", "global.1"]
    assert torch.equal(other.groups[1].subsets[cid], odd.subsets[cid])
    assert list(other.transport.runtime.subset_sampler(other.fit_task(0, other.groups[1], cid))) == after != first


def test_split_samples_rejects_a_bad_assignment(tmp_path):
    fed = build_federation(tmp_path)
    fed.setup()
    with pytest.raises(ValueError, match="no valid assignment"):
        fed.split_samples(fed.groups[0], {c: torch.zeros(1, dtype=torch.int64) for c in fed.data.client_ids}, 2)
