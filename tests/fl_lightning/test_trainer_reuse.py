"""One Trainer, N clients × R rounds: exactly the intended epochs, steps and hook calls per client."""

import warnings
from collections import Counter, defaultdict

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import FederatedCallback
from fl_lightning.runtime.local_fit import LocalFitter
from tests.conftest import build_federation, tiny_data, tiny_model


class HookCounter(FederatedCallback):
    """Counts Lightning hooks per client (the current client is set by the round hook)."""

    def __init__(self):
        self.client = None
        self.counts = defaultdict(Counter)

    def on_client_start(self, ctx, module):
        client_id = ctx.client_id
        self.client = client_id
        self.counts[client_id]["client_start"] += 1

    def on_fit_start(self, trainer, pl_module):
        self.counts[self.client]["fit"] += 1

    def on_train_epoch_start(self, trainer, pl_module):
        self.counts[self.client]["epoch"] += 1

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.counts[self.client]["batch"] += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.counts[self.client]["step"] += 1


@pytest.mark.parametrize(("local_epochs", "local_steps"), [(2, None), (1, 5)])
def test_each_client_runs_its_budget_every_round(tmp_path, local_epochs, local_steps):
    counter = HookCounter()
    data = tiny_data(num_clients=3)
    fed = build_federation(tmp_path, [counter], data=data, rounds=3, local_epochs=local_epochs, local_steps=local_steps)
    fed.run()
    for cid in data.client_ids:
        batches_per_epoch = -(-data.num_train_samples(cid) // data.batch_size)
        per_round = local_steps if local_steps else local_epochs * batches_per_epoch
        c = counter.counts[cid]
        assert c["client_start"] == 3 and c["fit"] == 3
        assert c["epoch"] == 3 * (1 if local_steps else local_epochs)
        assert c["batch"] == c["step"] == 3 * per_round, cid
    total_epochs = sum(c["epoch"] for c in counter.counts.values())
    assert fed.trainer.current_epoch == total_epochs


def test_a_fit_that_runs_nothing_is_an_error():
    data = tiny_data()
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, max_epochs=0)
    fitter = LocalFitter(trainer)
    model = tiny_model(data)
    fitter.fit(model, data.client_train_loader("site0"), 1, "site0")
    empty = DataLoader(TensorDataset(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)), batch_size=4)
    with pytest.raises(RuntimeError, match="client 'siteX' ran no training batch"):
        fitter.fit(model, empty, 1, "siteX")


def test_stock_checkpoint_callbacks_are_refused():
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=True)
    with pytest.raises(ValueError, match="ModelCheckpoint"):
        LocalFitter(trainer)


def test_a_random_sampler_loader_is_warned_about_once():
    data = tiny_data()
    split = data.client_data("site0")
    dataset = TensorDataset(split.train_x, split.train_y)
    shuffled = DataLoader(dataset, batch_size=4, shuffle=True)
    fitter = LocalFitter(L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False))
    model = tiny_model(data)
    with pytest.warns(UserWarning, match="client 'site0' shuffles with torch's RandomSampler"):
        fitter.fit(model, shuffled, 1, "site0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fitter.fit(model, shuffled, 1, "site0")  # once per fitter
        fitter.fit(model, data.client_train_loader("site1"), 1, "site1")  # the project's sampler: no warning


def test_a_loader_without_a_generator_of_its_own_is_warned_about_once():
    data = tiny_data()
    split = data.client_data("site0")
    plain = DataLoader(TensorDataset(split.train_x, split.train_y), batch_size=4)  # no shuffle, no generator
    fitter = LocalFitter(L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False))
    model = tiny_model(data)
    with pytest.warns(UserWarning, match="client 'site0' has no generator of its own") as record:
        fitter.fit(model, plain, 1, "site0")
    assert "RandomSampler" not in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fitter.fit(model, plain, 1, "site0")  # once per fitter
        fitter.fit(model, data.client_train_loader("site1"), 1, "site1")  # the project's loader has one


def test_a_datamodule_reused_by_a_second_run_gives_it_the_same_batches(tmp_path):
    """Failed before: the second run started from the first one's sampler passes and drew different batches."""
    data = tiny_data()
    finals = []
    for name in ("first", "second"):
        torch.manual_seed(0)
        fed = build_federation(tmp_path, data=data, model=tiny_model(data), rounds=2, run_name=name)
        fed.run()
        finals.append({k: v.clone() for k, v in fed.groups[0].state.items()})
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
