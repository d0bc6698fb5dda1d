"""The validation split carved out of each client's training data: sizes, strata, cases, seeds, errors, loaders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules.base import ClientSplit
from datamodules.validation import carve_validation, with_validation
from tests.conftest import tiny_data


def test_zero_keeps_the_training_data_as_they_are_and_gives_empty_validation_sets():
    plain, zero = tiny_data(), tiny_data(val_fraction=0.0)
    assert not zero.has_validation
    for cid in plain.client_ids:
        a, b = plain.client_data(cid), zero.client_data(cid)
        assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y, b.train_y)
        assert torch.equal(a.test_x, b.test_x)
        assert b.val_x.shape == (0, *a.train_x.shape[1:]) and zero.num_val_samples(cid) == 0
        assert len(list(zero.client_val_loader(cid))) == 0


def test_the_split_comes_out_of_training_is_stratified_seeded_and_leaves_test_alone():
    plain, data = tiny_data(), tiny_data(val_fraction=0.25)
    assert data.has_validation
    for cid in data.client_ids:
        before, after = plain.client_data(cid), data.client_data(cid)
        n = len(before.train_y)
        assert len(after.val_y) == round(n * 0.25) and len(after.train_y) + len(after.val_y) == n
        assert torch.equal(after.test_x, before.test_x) and torch.equal(after.test_y, before.test_y)
        # together they are the old training set, each image once
        merged = torch.cat([after.train_x, after.val_x]).flatten(1)
        assert sorted(map(tuple, merged.tolist())) == sorted(map(tuple, before.train_x.flatten(1).tolist()))
        # stratified: each class's share in validation is within one sample of its share in training data
        counts = torch.bincount(before.train_y, minlength=10).double()
        held = torch.bincount(after.val_y, minlength=10).double()
        assert torch.all((held - counts * 0.25).abs() <= 1.0)
        assert data.num_train_samples(cid) == len(after.train_y) and data.num_val_samples(cid) == len(after.val_y)
        assert data.label_counts(cid, "val").sum() == len(after.val_y)
    again = tiny_data(val_fraction=0.25)
    other_seed = tiny_data(val_fraction=0.25, seed=1)
    assert all(torch.equal(data.client_data(c).val_y, again.client_data(c).val_y) for c in data.client_ids)
    assert any(not torch.equal(data.client_data(c).val_x, other_seed.client_data(c).val_x) for c in data.client_ids)


def test_loaders_serve_the_split_asked_for():
    data = tiny_data(val_fraction=0.25)
    cid = data.client_ids[0]
    val = torch.cat([y for _, y in data.client_eval_loader(cid, "val")])
    test = torch.cat([y for _, y in data.client_eval_loader(cid, "test")])
    assert torch.equal(val, data.client_data(cid).val_y) and torch.equal(test, data.client_data(cid).test_y)
    pooled = torch.cat([y for _, y in data.val_dataloader()])
    assert len(pooled) == sum(data.num_val_samples(c) for c in data.client_ids)
    with pytest.raises(ValueError, match="split"):
        data.client_eval_loader(cid, "train")


def test_a_client_too_small_for_a_validation_split_is_named():
    with pytest.raises(ValueError, match=r"client 'site\d'.*val_fraction=0\.01"):
        tiny_data(val_fraction=0.01).setup()


def test_out_of_range_fractions_are_refused():
    with pytest.raises(ValueError, match="val_fraction"):
        tiny_data(val_fraction=1.0)


def test_cases_go_whole_to_one_side():
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1])
    cases = torch.tensor([5, 5, 5, 7, 7, 7, 9, 9, 2, 2, 4, 4])
    train, val = carve_validation(labels, cases, 0.4, seed=3)
    assert set(cases[train].tolist()).isdisjoint(cases[val].tolist())
    assert len(set(cases[val].tolist())) == 2  # round(5 cases × 0.4)
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(12))


def test_masks_are_split_at_random_and_a_case_column_is_carried():
    masks = torch.zeros(10, 4, 4, dtype=torch.int64)
    split = ClientSplit("a", torch.rand(10, 1, 4, 4), masks, torch.rand(2, 1, 4, 4), masks[:2],
                        train_case=torch.arange(10) // 2)  # fmt: skip
    out = with_validation(split, 0.4, seed=0, source="test")
    assert len(out.val_y) == 4 and len(out.train_y) == 6 and len(out.train_case) == 6
    assert set(out.train_case.tolist()).isdisjoint(set(range(5)) - set(out.train_case.tolist()))


def test_an_official_validation_split_is_kept_as_it_is():
    x, y = torch.rand(6, 1, 4, 4), torch.tensor([0, 1, 0, 1, 0, 1])
    split = ClientSplit("a", x, y, x[:2], y[:2], val_x=x[:1], val_y=y[:1])
    assert with_validation(split, 0.5, seed=0, source="test") is split
