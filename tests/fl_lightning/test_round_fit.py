"""Round fits (one ``trainer.fit`` per runtime per round) train every client exactly as a fit of its own would.

Three paths of local training: one fit per client (``federation.round_fit=false``), a round fit whose clients'
epochs are Lightning epochs (``federation.client_loop=false``), and a round fit whose clients each train inside one
Lightning step (the client loop, the default).
"""

from collections import Counter, defaultdict
from typing import NamedTuple

import lightning as L
import pytest
import torch

from callbacks import FedBN, FedDyn, FederatedCallback, FedProx, LRSchedule, Moon, Scaffold
from fl_lightning.cli import TRAINER_DEFAULTS
from fl_lightning.errors import PreconditionError
from fl_lightning.runtime import client_runtime
from fl_lightning.runtime.local_fit import LocalFitter
from fl_lightning.runtime.round_fit import client_loop_blocker, round_fit_blocker
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


PATHS = {
    "client loop": {"round_fit": True, "client_loop": True},
    "epochs": {"round_fit": True, "client_loop": False},
    "per client": {"round_fit": False},
}
LOOP_NOTE = "round fits run Lightning's loop for every local step"


class Run(NamedTuple):
    states: dict
    fits: int
    summary: dict
    fed: object
    notes: list


def run_paths(tmp_path, make_callbacks, **config):
    """The same run on each of :data:`PATHS`: its final states, ``trainer.fit`` calls, summary and log notes."""
    out = {}
    for name, flags in PATHS.items():
        fed = build_federation(tmp_path / name.replace(" ", "_"), make_callbacks(), **flags, **config)
        notes = []
        fed.transport.runtime.note = notes.append
        calls = counting_fits(fed)
        summary = fed.run()
        out[name] = Run(final_states(fed), calls["fit"], summary, fed, notes)
    return out


def assert_paths_agree(runs):
    for name in ("epochs", "per client"):
        assert_same_states(runs["client loop"].states, runs[name].states)
        assert runs["client loop"].summary["summary"] == runs[name].summary["summary"]  # train losses, test metrics


def assert_client_loop_ran(run):
    assert not [n for n in run.notes if n.startswith(LOOP_NOTE)]
    module = run.fed.transport.runtime.module
    assert "training_step" not in vars(module) and module.automatic_optimization  # both restored after the fits


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
    runs = run_paths(tmp_path, METHODS[method], rounds=2, model_kwargs={"norm": "batch"} if method == "fedbn" else None)
    assert_paths_agree(runs)
    assert_client_loop_ran(runs["client loop"])
    clients = len(runs["per client"].fed.data.client_ids)
    assert runs["per client"].fits == 2 * clients  # one fit per client and round
    assert runs["client loop"].fits == runs["epochs"].fits == 2  # one fit per round


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
    runs = run_paths(tmp_path, lambda: [FedProx(mu=0.1)], rounds=2, model_kwargs=model_kwargs, **config)
    assert_paths_agree(runs)
    assert_client_loop_ran(runs["client loop"])
    assert runs["client loop"].fits == runs["epochs"].fits == 2
    if "keep_optimizer_state" in config:
        kept = runs["client loop"].fed.transport.optimizer_states
        for name in ("epochs", "per client"):
            others = runs[name].fed.transport.optimizer_states
            assert kept and kept.keys() == others.keys()
            for key, state in kept.items():
                for p, buffers in state["state"].items():
                    assert torch.equal(buffers["momentum_buffer"], others[key]["state"][p]["momentum_buffer"])


class ClientHooks(FederatedCallback):
    """Counts, per client, its ``on_train_start``/``on_train_end`` and keeps the optimisers it trained with."""

    def __init__(self):
        self.client = None
        self.counts = defaultdict(Counter)
        # per client, id → optimiser: keeping the objects means no later optimiser can be given a freed one's id
        self.optimizers = defaultdict(dict)

    def on_client_start(self, ctx, module):
        self.client = ctx.client_id

    def on_train_start(self, trainer, pl_module):
        self.counts[self.client]["train_start"] += 1
        optimizer = trainer.optimizers[0]
        self.optimizers[self.client][id(optimizer)] = optimizer

    def on_train_end(self, trainer, pl_module):
        self.counts[self.client]["train_end"] += 1


class PerClientHooks(ClientHooks):
    """Also the epoch and step hooks a round fit must run per client (and none that run once per fit)."""

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


class InjectedFailure(FederatedCallback):
    """Makes one client fail inside its training (where, a subclass says): by raising, or by NaN weights."""

    def __init__(self, client_id, how):
        self.client_id, self.how, self.client = client_id, how, None

    def on_client_start(self, ctx, module):
        self.client = ctx.client_id

    def fail(self, pl_module, how):
        """Inject the failure ``how`` if this is the client's training and its kind."""
        if self.how != how or self.client != self.client_id:
            return
        if how == "raise":
            raise RuntimeError(f"injected failure of {self.client}")
        with torch.no_grad():
            pl_module.net.classifier.bias.fill_(float("nan"))


class FailOn(InjectedFailure):
    """Fails in the batch hooks: raising at a batch's start, NaN weights at its end."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.fail(pl_module, "raise")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.fail(pl_module, "nan")


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_failing_client_is_dropped_and_the_clients_after_it_still_train(tmp_path, how):
    with pytest.warns(UserWarning, match="client 'site1' failed"):
        runs = run_paths(tmp_path, lambda: [FailOn("site1", how)], rounds=2)
    assert_paths_agree(runs)
    # raising ends that round fit, the clients after it train in the next: 2 fits per round; NaN does not end it
    assert runs["epochs"].fits == (4 if how == "raise" else 2)
    # FailOn's batch hooks keep Lightning's loop per step, and the log says so once
    assert runs["client loop"].notes == [
        f"{LOOP_NOTE}: callback FailOn overrides on_train_batch_start, which a client loop calls once per client, "
        "not per local batch"
    ]


class FailInStep(InjectedFailure):
    """Fails in a per-step hook the client loop keeps."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.fail(pl_module, self.how)


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_client_failing_in_the_client_loop_is_dropped_and_the_clients_after_it_still_train(tmp_path, how):
    with pytest.warns(UserWarning, match="client 'site1' failed"):
        runs = run_paths(tmp_path, lambda: [FailInStep("site1", how)], rounds=2)
    assert_paths_agree(runs)
    assert_client_loop_ran(runs["client loop"])  # also after a fit that raised
    assert runs["client loop"].fits == (4 if how == "raise" else 2)


def test_an_error_starting_a_later_client_fails_the_run_as_in_its_own_fit(tmp_path):
    class BadStart(FederatedCallback):
        def on_client_start(self, ctx, module):
            if ctx.client_id == "site2":
                raise ValueError("site2 cannot start")

    for name, flags in PATHS.items():
        fed = build_federation(tmp_path / name.replace(" ", "_"), [BadStart()], rounds=1, **flags)
        with pytest.raises(ValueError, match="site2 cannot start"):
            fed.run()


def test_round_fits_split_when_their_replies_would_not_fit_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(client_runtime, "ROUND_FIT_BYTES", 1)  # one client per round fit
    runs = run_paths(tmp_path, lambda: [Scaffold()], rounds=2)
    assert_paths_agree(runs)
    assert runs["client loop"].fits == runs["epochs"].fits == runs["per client"].fits


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


class MatmulOnGradients(FederatedCallback):
    """Edits a gradient with a matrix product, which autocast would compute in bfloat16."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        g = pl_module.net.classifier.weight.grad
        g.add_(g @ g.T @ g, alpha=1e-3)


def test_mixed_precision_trains_alike_on_every_path(tmp_path):
    """Under autocast the client loop runs only the forward pass in it, as automatic optimisation does."""
    make = lambda: [FedProx(mu=0.1), MatmulOnGradients()]  # noqa: E731
    runs = run_paths(tmp_path, make, rounds=2, trainer_kwargs={"precision": "bf16-mixed"})
    assert_paths_agree(runs)
    assert_client_loop_ran(runs["client loop"])


class PerStepHooks(ClientHooks):
    """Also the hooks a client loop keeps per local step (no batch or epoch hook, which would keep Lightning's)."""

    def __init__(self):
        super().__init__()
        self.order = []

    def on_before_backward(self, trainer, pl_module, loss):
        self.counts[self.client]["before_backward"] += 1
        self.order.append("backward")
        # automatic optimisation's order: the gradients are zeroed after the forward pass, before backward
        assert all(p.grad is None for p in pl_module.parameters())

    def on_after_backward(self, trainer, pl_module):
        self.counts[self.client]["after_backward"] += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.counts[self.client]["step"] += 1
        self.order.append("step")


def test_the_client_loop_runs_the_per_client_and_per_step_hooks_of_every_client(tmp_path):
    hooks = PerStepHooks()
    data = tiny_data(num_clients=3)
    fed = build_federation(tmp_path, [hooks], data=data, rounds=2, local_epochs=2)
    notes = []
    fed.transport.runtime.note = notes.append
    calls = counting_fits(fed)
    fed.run()
    assert calls["fit"] == 2 and not notes
    for cid in data.client_ids:
        steps = 2 * 2 * -(-data.num_train_samples(cid) // data.batch_size)  # rounds × local epochs × batches
        counts = {"train_start": 2, "train_end": 2, "before_backward": steps, "after_backward": steps, "step": steps}
        assert hooks.counts[cid] == counts, cid
    assert hooks.order == ["backward", "step"] * (len(hooks.order) // 2)
    every = [o for ids in hooks.optimizers.values() for o in ids]
    assert len(every) == len(set(every))  # a fresh optimiser per client


def test_what_keeps_lightnings_loop_per_step_is_named():
    data = tiny_data()
    model_class = type(tiny_model(data))

    def blocker(module=None, callbacks=(), **trainer_args):
        args = {**TRAINER_DEFAULTS, "accelerator": "cpu", "logger": False, "callbacks": list(callbacks)}
        trainer = L.Trainer(**{**args, **trainer_args})
        LocalFitter(trainer)
        return client_loop_blocker(trainer, module or tiny_model(data))

    def module_of(cls):
        return cls(num_classes=data.num_classes, in_channels=data.in_channels, image_size=data.image_size, width=4)

    class Batches(L.Callback):
        def on_train_batch_end(self, *args):
            pass

    class ZeroGrads(L.Callback):
        def on_before_zero_grad(self, *args):
            pass

    class OwnStep(model_class):
        def optimizer_step(self, *args, **kwargs):
            super().optimizer_step(*args, **kwargs)

    class Scheduled(model_class):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    class Manual(model_class):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization = False

    class OwnTrainingStep(model_class):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx)

    assert blocker() is None
    assert blocker(callbacks=[Batches()]) == (
        "callback Batches overrides on_train_batch_end, which a client loop calls once per client, not per local batch"
    )
    assert "ZeroGrads overrides on_before_zero_grad" in blocker(callbacks=[ZeroGrads()])
    assert "OwnStep overrides optimizer_step" in blocker(module_of(OwnStep))
    assert "learning-rate scheduler" in blocker(module_of(Scheduled))
    assert "automatic optimisation off" in blocker(module_of(Manual))
    assert "does not use ClientModule's training_step" in blocker(module_of(OwnTrainingStep))
    assert "trainer.gradient_clip_val" in blocker(gradient_clip_val=1.0)
    assert "trainer.accumulate_grad_batches" in blocker(accumulate_grad_batches=2)
    assert "trainer.limit_train_batches" in blocker(limit_train_batches=2)
    assert "HalfPrecision is not 32-bit or mixed" in blocker(precision="bf16-true")
    assert blocker(precision="bf16-mixed") is None


class EpochSampler(torch.utils.data.Sampler):
    """A sampler Lightning would give the Trainer's epoch (``set_epoch``), in order."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        pass


class EpochSampled(FederatedCallback):
    def wrap_train_loader(self, ctx, loader):
        sampler = EpochSampler(len(loader.dataset))
        return torch.utils.data.DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)


def test_a_loader_whose_sampler_takes_the_trainers_epoch_is_refused_by_the_client_loop(tmp_path):
    fed = build_federation(tmp_path / "loop", [EpochSampled()], rounds=1)
    with pytest.raises(PreconditionError, match="client 'site0'.*EpochSampler.*federation.client_loop=false"):
        fed.run()
    module = fed.transport.runtime.module
    assert "training_step" not in vars(module) and module.automatic_optimization
    build_federation(tmp_path / "epochs", [EpochSampled()], rounds=1, client_loop=False).run()
