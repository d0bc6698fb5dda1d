"""Loaders that read a batch at a time give exactly the batches of a per-sample TensorDataset with default collation."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from datamodules.base import BatchTensorDataset, keep_batch
from datamodules.sampler import SeededEpochSampler
from fl_lightning.ops.dp_sgd import poisson_loader
from tests.conftest import tiny_data


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert isinstance(a, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            assert x.is_contiguous()


def test_batch_reads_equal_per_sample_reads_and_default_collation():
    x, y, w = torch.randn(37, 3, 4, 4), torch.randint(0, 5, (37,)), torch.rand(37)
    for fields in ((x, y), (x, y, w)):
        batched = DataLoader(BatchTensorDataset(*fields), batch_size=8, sampler=SeededEpochSampler(37, 3),
                             collate_fn=keep_batch)  # fmt: skip
        plain = DataLoader(TensorDataset(*fields), batch_size=8, sampler=SeededEpochSampler(37, 3))
        for _ in range(2):  # two passes: the samplers advance alike
            assert_same_batches(list(batched), list(plain))


def test_the_datamodules_loaders_read_batches_and_keep_their_batch_size_and_sampler():
    data = tiny_data(num_clients=2)
    cid = data.client_ids[0]
    loader = data.client_train_loader(cid)
    assert isinstance(loader.dataset, BatchTensorDataset) and loader.collate_fn is keep_batch
    assert loader.batch_size == data.batch_size and isinstance(loader.sampler, SeededEpochSampler)
    fresh = tiny_data(num_clients=2)  # the same client's first pass, read one sample at a time
    tensors = fresh.client_train_loader(cid).dataset.tensors
    sampler = SeededEpochSampler(len(tensors[0]), fresh.client_train_loader(cid).sampler.seed)
    assert_same_batches(list(loader), list(DataLoader(TensorDataset(*tensors), batch_size=data.batch_size,
                                                      sampler=sampler)))  # fmt: skip
    test = data.client_test_loader(cid)
    assert_same_batches(list(test), list(DataLoader(TensorDataset(*test.dataset.tensors), batch_size=256)))


def test_the_poisson_loader_over_batch_reads_draws_the_same_batches_and_empty_ones():
    x, y = torch.randn(20, 2), torch.randint(0, 3, (20,))

    def batches(dataset, collate):
        return list(poisson_loader(dataset, 0.1, 30, torch.Generator().manual_seed(0), collate))

    got = batches(BatchTensorDataset(x, y), keep_batch)
    want = batches(TensorDataset(x, y), torch.utils.data.default_collate)
    assert any(len(b[0]) == 0 for b in got)  # at q = 0.1 some draws are empty
    for a, b in zip(got, want, strict=True):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert u.shape == v.shape and u.dtype == v.dtype and torch.equal(u, v)


def test_a_loader_given_its_own_collate_function_still_gets_samples():
    """A subclass's augmentation collate (as in test_resume_safety) sees per-sample tuples, as with TensorDataset."""
    x, y = torch.randn(10, 1, 2, 2), torch.arange(10)
    seen = []

    def collate(samples):
        seen.append([tuple(t.shape) for t in samples[0]])
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    loader = DataLoader(BatchTensorDataset(x, y), batch_size=4, collate_fn=collate)
    batches = list(loader)
    assert seen[0] == [(1, 2, 2), ()]
    assert torch.equal(torch.cat([b[0] for b in batches]), x) and torch.equal(torch.cat([b[1] for b in batches]), y)
