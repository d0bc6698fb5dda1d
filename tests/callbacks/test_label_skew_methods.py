"""SCAFFOLD, FedNova, FedOpt, MOON, Reweighting and FedShift in the Federation, against plain-PyTorch references."""

import copy

import pytest
import torch
import torch.nn.functional as F

from callbacks import ClassifierShift, FederatedCallback, FedNova, FedOpt, Moon, Reweighting, Scaffold
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.label_shift import inverse_prior_weights
from fl_lightning.wire.protocol import Task
from tests.conftest import build_federation, reference_scaffold, tiny_data, tiny_model

LR = 0.1


def assert_states_close(a, b, atol=0.0, keys=None):
    for k in keys or a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def net_keys(state):
    return [k for k in state if k.startswith("net.") and state[k].is_floating_point()]


class Uploads(FederatedCallback):
    """Records each client's uploaded state before any other callback rewrites it (listed first)."""

    def __init__(self):
        self.states, self.steps = {}, {}

    def on_client_end(self, ctx, module, update):
        client_id = ctx.client_id
        self.states[client_id] = {k: v.clone() for k, v in update.state.items()}
        self.steps[client_id] = update.num_steps


def run(tmp_path, name, callbacks=(), **kwargs):
    fed = build_federation(tmp_path / name, list(callbacks), **kwargs)
    fed.run()
    return fed


# ---------------------------------------------------------------- SCAFFOLD


def test_scaffold_matches_a_hand_written_reference(tmp_path):
    fed = run(tmp_path, "s", [Scaffold()], rounds=3, clients_per_round=2)
    w, c = reference_scaffold(rounds=3, per_round=2, lrs=[LR] * 3)
    keys = net_keys(w)
    assert_states_close(fed.groups[0].state, w, atol=1e-5, keys=keys)
    assert_states_close(fed.callbacks[0].c, c, atol=1e-4)
    assert any(v.abs().max() > 0 for v in fed.callbacks[0].c.values())


def test_scaffold_with_frozen_zero_controls_is_fedavg(tmp_path):
    plain = run(tmp_path, "a")
    frozen = run(tmp_path, "b", [Scaffold(update_controls=False)])
    assert_states_close(plain.groups[0].state, frozen.groups[0].state)


def test_scaffold_refuses_momentum(tmp_path):
    fed = build_federation(tmp_path, [Scaffold()], model_kwargs={"momentum": 0.9})
    with pytest.raises(PreconditionError, match="model.momentum=0"):
        fed.run()


# ---------------------------------------------------------------- FedNova


def test_fednova_with_equal_steps_is_fedavg(tmp_path):
    plain = run(tmp_path, "a", local_steps=3, model_kwargs={"momentum": 0.9})
    nova = run(tmp_path, "b", [FedNova()], local_steps=3, model_kwargs={"momentum": 0.9})
    assert_states_close(plain.groups[0].state, nova.groups[0].state, atol=1e-6)


def test_fednova_with_unequal_steps_matches_hand_computation(tmp_path):
    data_kwargs = {
        "num_clients": 3,
        "partition": "dirichlet",
        "alpha": 0.3,
        "max_samples_per_client": None,
        "batch_size": 64,
    }
    uploads = Uploads()
    nova = run(tmp_path, "n", [uploads, FedNova()], data=tiny_data(**data_kwargs), rounds=1)
    w0 = tiny_model(tiny_data(**data_kwargs)).state_dict()
    steps = list(uploads.steps.values())
    assert len(set(steps)) > 1, "the test needs clients with different step counts"
    n = [nova.data.num_train_samples(c) for c in uploads.states]
    p = [ni / sum(n) for ni in n]
    tau_eff = sum(pi * s for pi, s in zip(p, steps))
    for k in [name for name, _ in nova.module.named_parameters()]:
        d = sum(pi * (w0[k] - st[k]) / s for pi, st, s in zip(p, uploads.states.values(), steps))
        torch.testing.assert_close(nova.groups[0].state[k], w0[k] - tau_eff * d, rtol=0, atol=1e-6)
    plain = sum(pi * st["net.classifier.weight"] for pi, st in zip(p, uploads.states.values()))
    assert not torch.allclose(nova.groups[0].state["net.classifier.weight"], plain, atol=1e-4)


# ---------------------------------------------------------------- FedOpt


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
@pytest.mark.parametrize("initial", [None, 0.0])
def test_fedopt_first_server_step_by_hand(tmp_path, kind, initial):
    """v₋₁ = τ² (Reddi et al. 2021, Alg. 2; the default) or 0 (``initial_accumulator=0``)."""
    plain = run(tmp_path, "a", rounds=1)
    opt = run(
        tmp_path, "b", [FedOpt(kind, lr=0.01, betas=(0.9, 0.99), eps=1e-3, initial_accumulator=initial)], rounds=1
    )
    w0 = tiny_model(tiny_data()).state_dict()
    v0 = 1e-6 if initial is None else 0.0
    for k, _ in opt.module.named_parameters():
        delta = plain.groups[0].state[k] - w0[k]
        m = 0.1 * delta
        sq = delta**2
        v = {"adam": 0.99 * v0 + 0.01 * sq, "yogi": v0 - 0.01 * sq * torch.sign(v0 - sq), "adagrad": v0 + sq}[kind]
        torch.testing.assert_close(opt.groups[0].state[k], w0[k] + 0.01 * m / (v.sqrt() + 1e-3), rtol=0, atol=1e-6)
    buffers = [k for k in w0 if "running" in k]
    assert buffers and all(torch.equal(opt.groups[0].state[k], plain.groups[0].state[k]) for k in buffers)


def test_fedopt_initial_accumulator_changes_the_first_step(tmp_path):
    paper = run(tmp_path, "p", [FedOpt("adam", initial_accumulator=None)], rounds=1)
    zero = run(tmp_path, "z", [FedOpt("adam", initial_accumulator=0.0)], rounds=1)
    key = next(k for k, _ in paper.module.named_parameters())
    assert not torch.equal(paper.groups[0].state[key], zero.groups[0].state[key])
    with pytest.raises(ValueError, match="initial_accumulator"):
        FedOpt(initial_accumulator=-1.0)


# ---------------------------------------------------------------- MOON


def test_moon_mu_zero_is_fedavg(tmp_path):
    plain = run(tmp_path, "a", model_kwargs={"momentum": 0.9})
    moon = run(tmp_path, "b", [Moon(mu=0.0)], model_kwargs={"momentum": 0.9})
    assert_states_close(plain.groups[0].state, moon.groups[0].state)


class TermProbe(FederatedCallback):
    """Checks MOON's term on the first batch of a client's second fit against a hand computation."""

    def __init__(self, moon):
        self.moon, self.checked = moon, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ctx = self.moon.fit_context
        if batch_idx or "previous" not in ctx.state or "moon" not in pl_module.loss_terms:
            return
        x = batch[0]
        with torch.no_grad():
            # copies first: a train-mode forward below updates BatchNorm running statistics
            glob = copy.deepcopy(pl_module.net).eval()
            prev = copy.deepcopy(pl_module.net).eval()
            prev.load_state_dict(ctx.state["previous"])
            z = pl_module.net.features(x)
            zg, zp = glob.features(x), prev.features(x)
            sim_g, sim_p = F.cosine_similarity(z, zg) / 0.5, F.cosine_similarity(z, zp) / 0.5
            expected = 2.0 * (-(sim_g - torch.logaddexp(sim_g, sim_p))).mean()
            got = pl_module.loss_terms["moon"](x=x, y=batch[1], logits=None, features=z, x_normalized=x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        self.checked += 1


def test_moon_term_matches_hand_computation(tmp_path):
    moon = Moon(mu=2.0, temperature=0.5)
    probe = TermProbe(moon)
    fed = run(tmp_path, "m", [moon, probe], rounds=2)
    assert probe.checked == len(fed.data.client_ids)  # every client, in its second round
    held = {c for c, states in fed.transport.runtime.callback_states.items() if "previous" in states[moon.state_key]}
    assert held == set(fed.data.client_ids)


def test_moon_needs_a_representation(tmp_path):
    data = tiny_data()
    model = tiny_model(data)
    model.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    with pytest.raises(PreconditionError, match="features"):
        build_federation(tmp_path, [Moon()], data=data, model=model).run()


# ---------------------------------------------------------------- Reweighting and FedShift


def uniform_counts(data, counts):
    data.label_counts = lambda client_id, split="train": counts.clone()
    return data


def test_reweighting_on_balanced_data_is_fedavg(tmp_path):
    counts = torch.full((10,), 4)
    plain = run(tmp_path, "a")
    rew = run(tmp_path, "b", [Reweighting()], data=uniform_counts(tiny_data(), counts))
    assert_states_close(plain.groups[0].state, rew.groups[0].state, keys=net_keys(plain.groups[0].state))


def test_reweighting_weights_the_loss(tmp_path):
    data = tiny_data(partition="dirichlet", alpha=0.3)
    rew = Reweighting()
    fed = build_federation(tmp_path, [rew], data=data)
    fed.setup()
    cid = data.client_ids[0]
    rew.on_client_start(fed.transport.runtime.context(rew, Task("fit", 0, cid, "global")), fed.module)
    x, y = next(iter(data.client_train_loader(cid)))
    weights = inverse_prior_weights(data.label_counts(cid)).float()
    expected = F.cross_entropy(fed.module(x), y, weight=weights)
    torch.testing.assert_close(fed.module.training_loss((x, y)), expected)
    assert not torch.allclose(expected, F.cross_entropy(fed.module(x), y))


def test_fedshift_shift_is_training_only_and_matches_hand(tmp_path):
    data = tiny_data(partition="dirichlet", alpha=0.3)
    shift = ClassifierShift(tau=1.0)
    fed = build_federation(tmp_path, [shift], data=data, rounds=1)
    fed.run()
    counts = {c: data.label_counts(c).double() for c in data.client_ids}
    pri = {c: (v + 1) / (v.sum() + 10) for c, v in counts.items()}
    n = sum(v.sum() for v in counts.values())
    glob = sum(v.sum() * pri[c] for c, v in counts.items()) / n
    shifts = {c: fed.transport.runtime.callback_states[c][shift.state_key]["shift"] for c in data.client_ids}
    for c in data.client_ids:
        torch.testing.assert_close(shifts[c].double(), pri[c].log() - glob.log(), atol=1e-6, rtol=0)
        # the client trained with its shift, but evaluation ignores it
        assert torch.allclose(fed.transport.private[("global", c)]["logit_adjustment"], shifts[c])
    module, loader = fed.module, data.client_test_loader(data.client_ids[0])
    module.load_state_dict(fed.groups[0].state)
    plain = module.evaluate(loader, torch.device("cpu"))
    module.logit_adjustment.copy_(shifts[data.client_ids[0]])
    assert module.evaluate(loader, torch.device("cpu")) == plain
    x, y = next(iter(loader))
    torch.testing.assert_close(module.training_loss((x, y)), F.cross_entropy(module(x) + module.logit_adjustment, y))


def test_fedshift_with_equal_priors_is_fedavg(tmp_path):
    counts = torch.full((10,), 3)
    plain = run(tmp_path, "a")
    shifted = run(tmp_path, "b", [ClassifierShift()], data=uniform_counts(tiny_data(), counts))
    key = shifted.callbacks[0].state_key
    assert all(states[key]["shift"].abs().max() < 1e-6 for states in shifted.transport.runtime.callback_states.values())
    assert_states_close(plain.groups[0].state, shifted.groups[0].state, atol=1e-5, keys=net_keys(plain.groups[0].state))


# ---------------------------------------------------------------- exact resume of server/client state


@pytest.mark.parametrize(
    "make", [Scaffold, lambda: FedOpt("adam"), lambda: Moon(mu=1.0)], ids=["scaffold", "fedadam", "moon"]
)
def test_resume_mid_run_is_exact(tmp_path, make):
    full = run(tmp_path, "full", [make()], rounds=4)
    run(tmp_path, "split", [make()], rounds=2, run_name="x")
    resumed = run(tmp_path, "split", [make()], rounds=4, run_name="x", resume="last")
    assert_states_close(full.groups[0].state, resumed.groups[0].state)
    # the server half's state and every client's private state of the method (kept by the runtime)
    a, b = ({"server": f.callbacks[0].state_dict(), "clients": {c: st[f.callbacks[0].state_key]
            for c, st in f.transport.runtime.callback_states.items()}} for f in (full, resumed))  # fmt: skip
    flat = lambda d: {f"{k}/{k2}": v for k, inner in d.items() for k2, v in _flatten(inner).items()}  # noqa: E731
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys() and fa
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


def _flatten(value, prefix=""):
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}/{k}"))
        return out
    return {}


def test_fednova_refuses_a_kept_momentum_buffer(tmp_path):
    """a_i assumes the momentum buffer starts at zero in each fit; a kept optimiser state breaks that."""
    kept = build_federation(tmp_path / "k", [FedNova()], keep_optimizer_state=True, model_kwargs={"momentum": 0.9})
    with pytest.raises(PreconditionError, match="keep_optimizer_state"):
        kept.run()
    build_federation(tmp_path / "plain", [FedNova()], keep_optimizer_state=True).run()  # no momentum: nothing kept
    build_federation(tmp_path / "fresh", [FedNova()], model_kwargs={"momentum": 0.9}).run()
