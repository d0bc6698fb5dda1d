"""Round fits (one ``trainer.fit`` per runtime per round) train every client exactly as a fit of its own would."""

from collections import Counter, defaultdict

import lightning as L
import pytest
import torch

from callbacks import FedBN, FedDyn, FederatedCallback, FedProx, LRSchedule, Moon, Scaffold
from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.runtime import client_runtime
from fl_lightning.runtime.local_fit import LocalFitter
from fl_lightning.runtime.round_fit import round_fit_blocker
from tests.conftest import build_federation, tiny_data, tiny_model


def counting_fits(fed):
    """Count the Trainer's ``fit`` calls of ``fed``'s runtime (the instance attribute shadows the method)."""
    trainer = fed.transport.runtime.trainer
    calls = Counter()
    fit = trainer.fit

    def counted(*args, **kwargs):
        calls["fit"] += 1
        return fit(*args, **kwargs)

    trainer.fit = counted
    return calls


def final_states(fed):
    return {g.name: {k: v.clone() for k, v in g.state.items()} for g in fed.groups}


def assert_same_states(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys()
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)


def run_both(tmp_path, make_callbacks, **config):
    """The same run with round fits and with one fit per client: states, train losses and the fits per path."""
    out = {}
    for round_fit in (True, False):
        fed = build_federation(tmp_path / str(round_fit), make_callbacks(), round_fit=round_fit, **config)
        calls = counting_fits(fed)
        summary = fed.run()
        out[round_fit] = (final_states(fed), calls["fit"], summary, fed)
    return out


METHODS = {
    "fedavg": lambda: [],
    "fedprox": lambda: [FedProx(mu=0.1)],
    "scaffold": lambda: [Scaffold()],
    "feddyn": lambda: [FedDyn(alpha=0.1)],
    "moon": lambda: [Moon(mu=1.0)],
    "fedbn": lambda: [FedBN()],
    "lr_schedule": lambda: [LRSchedule(kind="cosine")],
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_round_fits_give_the_per_client_weights_bit_for_bit(tmp_path, method):
    runs = run_both(tmp_path, METHODS[method], rounds=2, model_kwargs={"norm": "batch"} if method == "fedbn" else None)
    (round_states, round_fits, round_summary, fed), (client_states, client_fits, client_summary, _) = runs.values()
    assert_same_states(round_states, client_states)
    assert round_summary["summary"] == client_summary["summary"]  # the clients' train losses and test metrics
    clients = len(fed.data.client_ids)
    assert client_fits == 2 * clients  # one fit per client and round
    assert round_fits == 2  # one fit per round


@pytest.mark.parametrize(
    "config",
    [
        {"local_epochs": 2},
        {"local_steps": 5},
        {"keep_optimizer_state": True},
        {"clients_per_round": 2},
    ],
    ids=lambda c: next(iter(c)),
)
def test_budgets_kept_optimiser_state_and_sampling_match_the_per_client_path(tmp_path, config):
    model_kwargs = {"momentum": 0.9} if "keep_optimizer_state" in config else None
    runs = run_both(tmp_path, lambda: [FedProx(mu=0.1)], rounds=2, model_kwargs=model_kwargs, **config)
    assert_same_states(runs[True][0], runs[False][0])
    assert runs[True][1] == 2
    if "keep_optimizer_state" in config:
        kept = runs[True][3].transport.optimizer_states
        assert kept and kept.keys() == runs[False][3].transport.optimizer_states.keys()
        for key, state in kept.items():
            other = runs[False][3].transport.optimizer_states[key]
            for p, buffers in state["state"].items():
                assert torch.equal(buffers["momentum_buffer"], other["state"][p]["momentum_buffer"])


class PerClientHooks(FederatedCallback):
    """Counts, per client, the Lightning hooks a round fit must run per client (and none that run once per fit)."""

    def __init__(self):
        self.client = None
        self.counts = defaultdict(Counter)
        self.optimizers = defaultdict(set)

    def on_client_start(self, ctx, module):
        self.client = ctx.client_id

    def on_train_start(self, trainer, pl_module):
        self.counts[self.client]["train_start"] += 1
        self.optimizers[self.client].add(id(trainer.optimizers[0]))

    def on_train_end(self, trainer, pl_module):
        self.counts[self.client]["train_end"] += 1

    def on_train_epoch_start(self, trainer, pl_module):
        self.counts[self.client]["epoch"] += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.counts[self.client]["step"] += 1


def test_every_client_gets_its_own_train_start_end_epochs_steps_and_a_fresh_optimiser(tmp_path):
    hooks = PerClientHooks()
    data = tiny_data(num_clients=3)
    fed = build_federation(tmp_path, [hooks], data=data, rounds=2, local_epochs=2)
    calls = counting_fits(fed)
    fed.run()
    assert calls["fit"] == 2
    for cid in data.client_ids:
        batches = -(-data.num_train_samples(cid) // data.batch_size)
        assert hooks.counts[cid] == {"train_start": 2, "train_end": 2, "epoch": 4, "step": 4 * batches}, cid
    every = [o for ids in hooks.optimizers.values() for o in ids]
    assert len(every) == len(set(every))  # no client trained with another client's optimiser object


class FailOn(FederatedCallback):
    """Makes one client fail inside its training: by raising in a step, or by NaN weights."""

    def __init__(self, client_id, how):
        self.client_id, self.how, self.client = client_id, how, None

    def on_client_start(self, ctx, module):
        self.client = ctx.client_id

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.how == "raise" and self.client == self.client_id:
            raise RuntimeError(f"injected failure of {self.client}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.how == "nan" and self.client == self.client_id:
            with torch.no_grad():
                pl_module.net.classifier.bias.fill_(float("nan"))


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_failing_client_is_dropped_and_the_clients_after_it_still_train(tmp_path, how):
    with pytest.warns(UserWarning, match="client 'site1' failed"):
        runs = run_both(tmp_path, lambda: [FailOn("site1", how)], rounds=2)
    assert_same_states(runs[True][0], runs[False][0])
    # raising ends that round fit, the clients after it train in the next: 2 fits per round; NaN does not end it
    assert runs[True][1] == (4 if how == "raise" else 2)


def test_an_error_starting_a_later_client_fails_the_run_as_in_its_own_fit(tmp_path):
    class BadStart(FederatedCallback):
        def on_client_start(self, ctx, module):
            if ctx.client_id == "site2":
                raise ValueError("site2 cannot start")

    for round_fit in (True, False):
        fed = build_federation(tmp_path / str(round_fit), [BadStart()], rounds=1, round_fit=round_fit)
        with pytest.raises(ValueError, match="site2 cannot start"):
            fed.run()


def test_round_fits_split_when_their_replies_would_not_fit_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(client_runtime, "ROUND_FIT_BYTES", 1)  # one client per round fit
    runs = run_both(tmp_path, lambda: [Scaffold()], rounds=2)
    assert_same_states(runs[True][0], runs[False][0])
    assert runs[True][1] == runs[False][1]


class OncePerFit(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        pass


def test_a_callback_that_needs_a_fit_per_client_gets_one_and_the_log_says_why(tmp_path):
    notes = []
    fed = build_federation(tmp_path, [OncePerFit()], rounds=1)
    fed.transport.runtime.note = notes.append
    calls = counting_fits(fed)
    fed.run()
    assert calls["fit"] == len(fed.data.client_ids)
    assert notes.count("one Lightning fit per client: callback OncePerFit overrides on_fit_start, which Lightning "
                       "calls once per fit") == 1  # fmt: skip


def test_what_blocks_a_round_fit_is_named():
    data = tiny_data()

    def blocker(module=None, **trainer_args):
        trainer = L.Trainer(**{**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False, **trainer_args})
        LocalFitter(trainer)
        return round_fit_blocker(trainer, module or tiny_model(data))

    assert blocker() is None
    assert blocker(enable_progress_bar=True).endswith("ProgressBar overrides setup, which Lightning calls once per fit")
    assert "trainer.reload_dataloaders_every_n_epochs" in blocker(reload_dataloaders_every_n_epochs=2)
    assert "max_steps" in blocker(max_steps=100)
    assert "Timer overrides on_fit_start" in blocker(max_time="00:01:00:00")

    class EndsFits(type(tiny_model(data))):
        def on_fit_end(self):
            pass

    module = EndsFits(num_classes=data.num_classes, in_channels=data.in_channels, image_size=data.image_size, width=4)
    assert blocker(module) == "the module EndsFits overrides on_fit_end, which Lightning calls once per fit"
