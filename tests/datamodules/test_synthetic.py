"""SyntheticFederated: a datamodule's clients training on the buffers a FedER run saved."""

import pytest
import torch

from callbacks.feder.generator_store import GENERATORS_DIR, data_digest, save_node_gan
from datamodules import SyntheticFederated
from tests.conftest import build_federation, tiny_data


def fake_run(tmp_path, data, n=6):
    """A run directory whose generators/ holds, per client, a buffer of n constant images labelled by client index."""
    for i, cid in enumerate(data.client_ids):
        split = data.client_data(cid)
        save_node_gan(
            tmp_path / GENERATORS_DIR / f"{cid}.pt", generator={}, latents=torch.zeros(n, 2),
            labels=torch.full((n,), i), images=torch.full((n, *split.train_x.shape[1:]), 0.1 * (i + 1)),
            fingerprint={"data": data_digest(split.train_x, split.train_y)},
        )  # fmt: skip
    return tmp_path


def test_clients_train_on_their_buffer_and_keep_their_test_sets(tmp_path):
    base = tiny_data()
    run = fake_run(tmp_path, base)
    synthetic = SyntheticFederated(base, str(run))  # a run directory works...
    both = SyntheticFederated(base, str(run / GENERATORS_DIR), train_on="real_and_synthetic")  # ...and its generators/
    for i, cid in enumerate(base.client_ids):
        real, syn, mixed = base.client_data(cid), synthetic.client_data(cid), both.client_data(cid)
        assert torch.equal(syn.train_x, torch.full((6, *real.train_x.shape[1:]), 0.1 * (i + 1)))
        assert syn.train_y.tolist() == [i] * 6
        assert torch.equal(mixed.train_x, torch.cat([real.train_x, syn.train_x]))
        assert torch.equal(mixed.train_y, torch.cat([real.train_y, syn.train_y]))
        for d in (syn, mixed):
            assert torch.equal(d.test_x, real.test_x) and torch.equal(d.test_y, real.test_y)
    assert synthetic.num_classes == base.num_classes and synthetic.image_size == base.image_size


def test_centralised_training_on_synthetic_data_runs_through_the_federation(tmp_path):
    base = tiny_data()
    data = SyntheticFederated(base, str(fake_run(tmp_path / "feder", base)))
    summary = build_federation(tmp_path, data=data, rounds=1, mode="centralized").run()
    assert set(summary["clients"]) == set(base.client_ids)
    assert data.num_train_samples("site0") == 6


def test_buffers_of_other_data_or_missing_files_are_refused(tmp_path):
    run = fake_run(tmp_path, tiny_data(seed=1))
    with pytest.raises(ValueError, match="client 'site0'.*site0.pt.*other training data"):
        SyntheticFederated(tiny_data(), str(run)).client_data("site0")
    with pytest.raises(FileNotFoundError, match="nowhere/site0.pt"):
        SyntheticFederated(tiny_data(), str(tmp_path / "nowhere")).client_data("site0")
    with pytest.raises(ValueError, match="train_on"):
        SyntheticFederated(tiny_data(), str(run), train_on="real")
