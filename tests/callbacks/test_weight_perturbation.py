"""WeightPerturbation inside Lightning's automatic optimisation, against a hand-written SAM loop."""

import copy
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import FedProx, WeightPerturbation
from fl_lightning.clients.base import ClientModule
from fl_lightning.errors import PreconditionError

STEPS, BATCH = 4, 6


def make_net(batch_norm=False):
    torch.manual_seed(0)
    layers = [nn.Linear(5, 7)] + ([nn.BatchNorm1d(7)] if batch_norm else []) + [nn.Tanh(), nn.Linear(7, 3)]
    return nn.Sequential(*layers)


class Tiny(ClientModule):
    def __init__(self, net, optimizer="sgd", manual=False, two_optimizers=False):
        super().__init__()
        self.net, self.optimizer_name, self.two = net, optimizer, two_optimizers
        self.automatic_optimization = not manual

    def training_loss(self, batch):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def training_step(self, batch, batch_idx):
        if not self.automatic_optimization:
            return None
        return super().training_step(batch, batch_idx)

    def evaluate(self, batches, device):
        return {}

    def configure_optimizers(self):
        opt = make_optimizer(self.net.parameters(), self.optimizer_name)
        return [opt, make_optimizer(self.net.parameters(), "sgd")] if self.two else opt


def make_optimizer(params, name):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=0.01)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * BATCH, 5, generator=g)
    y = torch.randint(0, 3, (STEPS * BATCH,), generator=g)
    return x, y


def batches():
    x, y = data()
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def fit(module, callbacks, **trainer_kwargs):
    loader = DataLoader(TensorDataset(*data()), batch_size=BATCH, shuffle=False)
    args = {
        "accelerator": "cpu",
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    L.Trainer(**{**args, **trainer_kwargs}, callbacks=callbacks).fit(module, loader)
    return module.net


def reference_sam(net, alpha, optimizer="sgd", clip_norm=None):
    """Hand-written SAM: g at w; δ = α g/(‖g‖ + 1e-12); g' at w + δ; restore w; (clip g'); base step with g'."""
    net = copy.deepcopy(net).train()
    params = list(net.parameters())
    opt = make_optimizer(params, optimizer)
    for x, y in batches():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        norm = torch.sqrt(sum((p.grad**2).sum() for p in params))
        with torch.no_grad():
            deltas = [alpha * p.grad / (norm + 1e-12) for p in params]
            for p, d in zip(params, deltas):
                p.add_(d)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for p, d in zip(params, deltas):
                p.sub_(d)
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        opt.step()
    return net


def assert_same_params(a, b, atol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_equals_a_hand_written_sam_step(optimizer):
    net = make_net()
    got = fit(Tiny(copy.deepcopy(net), optimizer), [WeightPerturbation(alpha=0.5)])
    expected = reference_sam(net, alpha=0.5, optimizer=optimizer)
    assert_same_params(got, expected, atol=1e-6)
    plain = fit(Tiny(copy.deepcopy(net), optimizer), [])
    assert not torch.allclose(plain[0].weight, got[0].weight, atol=1e-4)  # the perturbation matters


def test_alpha_zero_equals_the_plain_optimiser_step():
    net = make_net()
    got = fit(Tiny(copy.deepcopy(net)), [WeightPerturbation(alpha=0.0)])
    plain = fit(Tiny(copy.deepcopy(net)), [])
    assert_same_params(got, plain, atol=0)
    tiny_alpha = fit(Tiny(copy.deepcopy(net)), [WeightPerturbation(alpha=1e-7)])
    assert_same_params(tiny_alpha, plain, atol=1e-5)


class StepProbe(L.Callback):
    """At every base step: the weights the optimiser is about to update, and the gradients it will use."""

    def __init__(self):
        self.start, self.at_step, self.grads = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start.append([p.detach().clone() for p in pl_module.parameters()])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.at_step.append([p.detach().clone() for p in pl_module.parameters()])
        self.grads.append([p.grad.clone() for p in pl_module.parameters()])


@pytest.mark.parametrize("probe_first", [True, False])
def test_weights_are_restored_before_the_base_step_whatever_the_callback_order(probe_first):
    probe, wp = StepProbe(), WeightPerturbation(alpha=0.5)
    module = Tiny(make_net())
    fit(module, [probe, wp] if probe_first else [wp, probe])
    assert len(probe.at_step) == STEPS
    for start, at_step, grads, (x, y) in zip(probe.start, probe.at_step, probe.grads, batches()):
        for a, b in zip(start, at_step):
            assert torch.equal(a, b)
        # The gradient the optimiser gets is g' = ∇ℓ(w + δ), computed here by hand from w.
        net = make_net()
        with torch.no_grad():
            for p, w in zip(net.parameters(), start):
                p.copy_(w)
        F.cross_entropy(net(x), y).backward()
        norm = torch.sqrt(sum((p.grad**2).sum() for p in net.parameters()))
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.5 * p.grad / (norm + 1e-12))
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        for g, p in zip(grads, net.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-6)


def test_gradient_clipping_applies_to_the_perturbed_gradient():
    net = make_net()
    got = fit(Tiny(copy.deepcopy(net)), [WeightPerturbation(alpha=0.5)], gradient_clip_val=0.05)
    expected = reference_sam(net, alpha=0.5, clip_norm=0.05)
    assert_same_params(got, expected, atol=1e-6)


def test_fedprox_term_is_added_to_the_perturbed_gradient_in_either_order():
    net = make_net()
    a = fit(Tiny(copy.deepcopy(net)), [WeightPerturbation(alpha=0.5), FedProx(mu=0.3)])
    b = fit(Tiny(copy.deepcopy(net)), [FedProx(mu=0.3), WeightPerturbation(alpha=0.5)])
    assert_same_params(a, b, atol=0)


def test_running_statistics_advance_once_per_step():
    net = make_net(batch_norm=True)
    got = fit(Tiny(copy.deepcopy(net)), [WeightPerturbation(alpha=0.5)])
    bn = got[1]
    assert int(bn.num_batches_tracked) == STEPS
    # Reference: the running mean follows the first pass (at w) of each step only.
    ref = copy.deepcopy(net).train()
    probe = StepProbe()
    fit(Tiny(copy.deepcopy(net)), [probe, WeightPerturbation(alpha=0.5)])
    running = torch.zeros(7)
    for start, (x, _) in zip(probe.start, batches()):
        with torch.no_grad():
            for p, w in zip(ref.parameters(), start):
                p.copy_(w)
            h = ref[0](x)
        running = 0.9 * running + 0.1 * h.mean(0)
    torch.testing.assert_close(bn.running_mean, running, rtol=0, atol=1e-6)


class RecordsAutocast(Tiny):
    def __init__(self, net):
        super().__init__(net)
        self.autocast = []

    def training_loss(self, batch):
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        return super().training_loss(batch)


def test_mixed_precision_keeps_weights_and_dtype_and_autocasts_both_passes():
    module = RecordsAutocast(make_net())
    probe = StepProbe()
    net = fit(module, [probe, WeightPerturbation(alpha=0.5)], precision="bf16-mixed")
    assert module.autocast == [True] * (2 * STEPS)
    assert all(p.dtype == torch.float32 for p in net.parameters())
    for start, at_step in zip(probe.start, probe.at_step):
        assert all(torch.equal(a, b) for a, b in zip(start, at_step))


def test_fp16_gradient_scaler_scales_the_second_pass_too():
    # Lightning refuses 16-mixed on CPU by flag, but its plugin runs there with a CPU GradScaler: the scaler
    # unscales g' after on_after_backward, so g' must be backpropagated from the scaled loss.
    net = make_net()
    plugin = MixedPrecision(precision="16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    got = fit(Tiny(copy.deepcopy(net)), [WeightPerturbation(alpha=0.5)], plugins=[plugin])
    assert_same_params(got, reference_sam(net, alpha=0.5), atol=1e-3)  # fp16 autocast error only


def test_preconditions_fail_loudly():
    with pytest.raises(PreconditionError, match="automatic optimisation"):
        fit(Tiny(make_net(), manual=True), [WeightPerturbation()])
    with pytest.raises(PreconditionError, match="accumulate_grad_batches"):
        fit(Tiny(make_net()), [WeightPerturbation()], accumulate_grad_batches=2)
    # The Federation's start-of-run check sees the module's optimisers before Lightning does.
    trainer = SimpleNamespace(accumulate_grad_batches=1)
    with pytest.raises(PreconditionError, match="exactly one optimiser"):
        WeightPerturbation().on_runtime_start(
            SimpleNamespace(module=Tiny(make_net(), two_optimizers=True), trainer=trainer)
        )
    with pytest.raises(PreconditionError, match="exactly one optimiser"):
        WeightPerturbation.check(trainer, Tiny(make_net()), num_optimizers=2)
    with pytest.raises(ValueError, match="alpha"):
        WeightPerturbation(alpha=-1.0)
