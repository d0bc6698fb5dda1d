"""Per-client train/test split and the base datamodule's validation of loaded data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules.base import ClientSplit, FederatedDataModule
from datamodules.split import split_train_test


def test_split_is_stratified_disjoint_and_complete() -> None:
    labels = np.repeat(np.arange(4), [50, 30, 10, 10])
    indices = np.arange(0, 200, 2)  # the client's samples are a subset of the pooled data
    pooled = np.full(200, -1)
    pooled[indices] = labels
    train, test = split_train_test(indices, pooled, 0.2, seed=0)
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), indices)
    assert len(np.intersect1d(train, test)) == 0
    assert len(test) == 20
    np.testing.assert_array_equal(np.bincount(pooled[test], minlength=4), [10, 6, 2, 2])


def test_split_deterministic_and_seeded() -> None:
    labels = np.arange(100) % 3
    a = split_train_test(np.arange(100), labels, 0.3, seed=1)
    b = split_train_test(np.arange(100), labels, 0.3, seed=1)
    c = split_train_test(np.arange(100), labels, 0.3, seed=2)
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_every_client_keeps_a_train_sample(n: int) -> None:
    labels = np.arange(n)  # one sample per class: stratification impossible
    train, test = split_train_test(np.arange(n), labels, 0.9, seed=0)
    assert len(train) >= 1
    assert len(train) + len(test) == n
    assert len(test) == min(round(n * 0.9), n - 1)


def test_rare_classes_stay_in_train() -> None:
    labels = np.array([0] * 20 + [1])
    train, test = split_train_test(np.arange(21), labels, 0.2, seed=0)
    assert 20 in train
    assert len(test) == 4


class _Fixed(FederatedDataModule):
    def __init__(self, splits: list[ClientSplit], num_classes: int | None = None, **kwargs: float) -> None:
        super().__init__(**kwargs)
        self._splits_to_load = splits
        self._declared_num_classes = num_classes
        self._source = "unit-test-source"

    def _load(self) -> list[ClientSplit]:
        return self._splits_to_load


def _client(cid: str, train_y: list[int], test_y: list[int] | None = None) -> ClientSplit:
    test_y = test_y or [0]
    return ClientSplit(
        client_id=cid,
        train_x=torch.zeros(len(train_y), 1, 2, 2),
        train_y=torch.tensor(train_y, dtype=torch.int64),
        test_x=torch.zeros(len(test_y), 1, 2, 2),
        test_y=torch.tensor(test_y, dtype=torch.int64),
    )


def test_label_out_of_range_names_client_source_and_value() -> None:
    dm = _Fixed([_client("a", [0, 1]), _client("b", [1, 7])], num_classes=3)
    with pytest.raises(ValueError, match=r"label 7 .*'b'.*unit-test-source"):
        dm.setup()


def test_client_without_training_samples_is_named() -> None:
    dm = _Fixed([_client("a", [0, 1]), _client("empty", [])])
    with pytest.raises(ValueError, match=r"client 'empty' has no training samples"):
        _ = dm.client_ids


def test_num_classes_inferred_and_load_happens_once() -> None:
    calls = []

    class Counting(_Fixed):
        def _load(self) -> list[ClientSplit]:
            calls.append(1)
            return super()._load()

    dm = Counting([_client("a", [0, 4]), _client("b", [2], test_y=[5])])
    assert dm.num_classes == 6
    dm.setup("fit")
    _ = dm.client_train_loader("a")
    assert len(calls) == 1


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="test_fraction"):
        _Fixed([], test_fraction=1.0)
    with pytest.raises(ValueError, match="batch_size"):
        _Fixed([], batch_size=0)
    with pytest.raises(ValueError, match="steps"):
        _Fixed([_client("a", [0])]).client_train_loader("a", steps=0)
