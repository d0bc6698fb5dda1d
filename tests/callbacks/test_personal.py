"""Ditto, MR-MTL and APFL: each against a plain-PyTorch reference and its limits; the personal models' evaluation."""

import copy
import csv
import json

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from callbacks import APFL, MRMTL, Ditto
from datamodules.sampler import SeededEpochSampler, stable_seed
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.apfl import alpha_step, mix_state
from tests.conftest import build_federation, reference_sgd, tiny_data, tiny_model

ATOL = 1e-6


def _net_state(net):
    """A network's (or a reference's state dict's) entries under the client module's names."""
    state = net if isinstance(net, dict) else net.state_dict()
    return {f"net.{k}": v for k, v in state.items()}


def _personal_batches(data, cid, method, rounds, seed=0):
    """The client's personal batches of each round: its training set through the method's own seeded sampler."""
    n = data.num_train_samples(cid)
    sampler = SeededEpochSampler(n, stable_seed(seed, method, "personal", cid))
    loader = data.client_subset_train_loader(cid, torch.arange(n), sampler)
    return [list(loader) for _ in range(rounds)]


def _assert_states_close(actual, expected, atol=ATOL):
    for k, v in expected.items():
        torch.testing.assert_close(actual[k], v, rtol=0, atol=atol, msg=k)


# ---------------------------------------------------------------- the pure parts


def test_alpha_step_is_the_autograd_derivative_through_the_mixture_and_stays_in_0_1():
    torch.manual_seed(0)
    v, w, x = torch.randn(5, 3), torch.randn(5, 3), torch.randn(4, 5)
    alpha = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    mixed = alpha * v.double() + (1 - alpha) * w.double()
    (x.double() @ mixed).pow(2).sum().backward()
    at_mixture = torch.lerp(w, v, 0.3).requires_grad_()
    (x @ at_mixture).pow(2).sum().backward()
    new = alpha_step(0.3, [v], [w], [at_mixture.grad], lr=1e-3)
    assert new == pytest.approx(0.3 - 1e-3 * alpha.grad.item(), rel=1e-5)
    assert alpha_step(0.3, [v], [w], [at_mixture.grad], lr=1e6) in (0.0, 1.0)
    assert alpha_step(0.3, [v], [w], [None], lr=1.0) == 0.3  # no gradient, no step


def test_mix_state_mixes_the_named_parameters_only():
    v = {"w": torch.ones(2), "n": torch.tensor(3), "stat": torch.full((2,), 5.0)}
    g = {"w": torch.zeros(2), "n": torch.tensor(9), "stat": torch.zeros(2)}
    out = mix_state(v, g, 0.25, {"w"})
    assert torch.equal(out["w"], torch.full((2,), 0.25))
    assert torch.equal(out["n"], v["n"]) and torch.equal(out["stat"], v["stat"])


# ---------------------------------------------------------------- Ditto


def test_ditto_global_model_is_fedavgs_bit_for_bit(tmp_path):
    fedavg = build_federation(tmp_path / "a", rounds=2)
    fedavg.run()
    ditto = build_federation(tmp_path / "d", callbacks=[Ditto(lam=0.5)], rounds=2)
    ditto.run()
    for k, v in fedavg.groups[0].state.items():
        assert torch.equal(ditto.groups[0].state[k], v), k
    assert set(ditto.transport.runtime.personal) == set(tiny_data().client_ids)


def test_ditto_with_lambda_zero_is_local_training(tmp_path):
    fed = build_federation(tmp_path, callbacks=[Ditto(lam=0.0)], rounds=2)
    fed.run()
    data = tiny_data()
    for cid in data.client_ids:
        ref = reference_sgd(tiny_model(data).net, _personal_batches(data, cid, "Ditto", 2), lr=0.1)
        _assert_states_close(fed.transport.runtime.personal[cid]["global"], _net_state(ref))


def test_ditto_personal_model_matches_a_proximal_reference(tmp_path):
    fed = build_federation(tmp_path, callbacks=[Ditto(lam=0.7)], rounds=1)
    fed.run()
    data = tiny_data()
    for cid in data.client_ids:  # round 1: v starts at w^0, the anchor
        ref = reference_sgd(tiny_model(data).net, _personal_batches(data, cid, "Ditto", 1), lr=0.1, mu=0.7)
        _assert_states_close(fed.transport.runtime.personal[cid]["global"], _net_state(ref))


def test_ditto_pulls_harder_towards_the_global_model_as_lambda_grows(tmp_path):
    init = tiny_model(tiny_data()).state_dict()
    distances = []
    for lam in (0.0, 1.0, 5.0):
        fed = build_federation(tmp_path / str(lam), callbacks=[Ditto(lam=lam)], rounds=1)
        fed.run()
        v = fed.transport.runtime.personal["site0"]["global"]
        distances.append(sum(float((v[k] - init[k]).pow(2).sum()) for k, _ in fed.module.named_parameters()))
    assert distances[0] > distances[1] > distances[2] > 0


def test_ditto_and_apfl_refuse_local_steps_and_two_personal_models(tmp_path):
    with pytest.raises(PreconditionError, match=r"set federation.local_epochs .*not federation.local_steps=2"):
        build_federation(tmp_path / "s", callbacks=[Ditto()], rounds=1, local_steps=2).run()
    with pytest.raises(PreconditionError, match=r"Ditto, APFL each train a personal model"):
        build_federation(tmp_path / "two", callbacks=[Ditto(), APFL()], rounds=1).run()


# ---------------------------------------------------------------- MR-MTL


def _mr_mtl_reference(data, rounds, lam):
    """MR-MTL written out: each client's own model, SGD with λ(v − v̄) on its batches, v̄ the weighted mean."""
    ids = list(data.client_ids)
    n = {c: data.num_train_samples(c) for c in ids}
    loaders = {c: data.client_train_loader(c) for c in ids}
    mean = tiny_model(data).net
    nets = {}
    for _ in range(rounds):
        states = {}
        for c in ids:
            start = nets.get(c, mean)
            net = copy.deepcopy(start)
            anchor = {k: p.detach().clone() for k, p in mean.named_parameters()}
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for x, y in loaders[c]:
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                with torch.no_grad():
                    for k, p in net.named_parameters():
                        p.grad.add_(p - anchor[k], alpha=lam)
                opt.step()
            nets[c], states[c] = net, net.state_dict()
        total = sum(n.values())
        mean = copy.deepcopy(mean)
        mean.load_state_dict(
            {
                k: (sum(states[c][k].double() * n[c] for c in ids) / total).to(v.dtype) if v.is_floating_point() else v
                for k, v in states[ids[0]].items()
            },
            strict=False,
        )
    return nets, mean


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_mr_mtl_matches_the_mean_regularised_reference(tmp_path, lam):
    fed = build_federation(tmp_path, callbacks=[MRMTL(lam=lam)], rounds=2)
    fed.run()
    nets, mean = _mr_mtl_reference(tiny_data(), 2, lam)
    for cid, net in nets.items():
        _assert_states_close(fed.transport.runtime.personal[cid]["global"], _net_state(net))
    params = {f"net.{k}": p for k, p in mean.named_parameters()}
    _assert_states_close(fed.groups[0].state, params)


def test_mr_mtl_with_lambda_zero_is_local_training(tmp_path):
    fed = build_federation(tmp_path, callbacks=[MRMTL(lam=0.0)], rounds=2)
    fed.run()
    data = tiny_data()
    for cid in data.client_ids:
        ref = reference_sgd(tiny_model(data).net, [data.client_train_loader(cid)] * 2, lr=0.1)
        _assert_states_close(fed.transport.runtime.personal[cid]["global"], _net_state(ref))


# ---------------------------------------------------------------- APFL


def _apfl_reference(data, cid, alpha, alpha_lr, adaptive=True):
    """One APFL round written out with autograd through the mixture: v and α leaves, v̄ = α v + (1 − α) w^0."""
    module = tiny_model(data)
    w = {k: p.detach().clone() for k, p in module.net.named_parameters()}
    v = {k: p.detach().clone().requires_grad_() for k, p in module.net.named_parameters()}
    buffers = {k: b.clone() for k, b in module.net.named_buffers()}
    a = torch.tensor(alpha, requires_grad=True)
    for x, y in _personal_batches(data, cid, "APFL", 1)[0]:
        mixed = {k: a * v[k] + (1 - a) * w[k] for k in v}
        out = functional_call(module.net, {**mixed, **buffers}, (x,))
        grads = torch.autograd.grad(F.cross_entropy(out, y), [*v.values(), a])
        with torch.no_grad():
            for p, g in zip(v.values(), grads[:-1]):
                p -= 0.1 * g
            if adaptive:
                a.copy_(torch.clamp(a - alpha_lr * grads[-1], 0, 1))
    own = {f"net.{k}": p.detach() for k, p in v.items()}
    return own, float(a), {f"net.{k}": t for k, t in w.items()}


@pytest.mark.parametrize(("alpha", "adaptive"), [(0.5, True), (0.8, True), (0.3, False)])
def test_apfl_round_matches_an_autograd_reference(tmp_path, alpha, adaptive):
    fed = build_federation(tmp_path, callbacks=[APFL(alpha=alpha, alpha_lr=0.05, adaptive=adaptive)], rounds=1)
    fed.run()
    data = tiny_data()
    for cid in data.client_ids:
        own, a, w = _apfl_reference(data, cid, alpha, 0.05, adaptive)
        state = fed.transport.runtime.callback_states[cid]["APFL"]
        assert state["alpha"] == pytest.approx(a, abs=1e-6)
        assert (abs(a - alpha) > 1e-6) == adaptive
        _assert_states_close(state["personal_model"], own, atol=1e-5)
        mixture = {k: a * own[k] + (1 - a) * w[k] for k in own}
        _assert_states_close(fed.transport.runtime.personal[cid]["global"], mixture, atol=1e-5)


def test_apfl_at_alpha_one_is_local_training_and_at_zero_keeps_the_global_model(tmp_path):
    data = tiny_data()
    init = tiny_model(data).state_dict()
    one = build_federation(tmp_path / "one", callbacks=[APFL(alpha=1.0, adaptive=False)], rounds=2)
    one.run()
    zero = build_federation(tmp_path / "zero", callbacks=[APFL(alpha=0.0, adaptive=False)], rounds=1)
    zero.run()
    for cid in data.client_ids:
        ref = reference_sgd(tiny_model(data).net, _personal_batches(data, cid, "APFL", 2), lr=0.1)
        _assert_states_close(one.transport.runtime.personal[cid]["global"], _net_state(ref))
        kept = zero.transport.runtime.personal[cid]["global"]
        for k, _ in zero.module.named_parameters():
            assert torch.equal(kept[k], init[k]), k  # the mixture is the received w^0


# ---------------------------------------------------------------- evaluation of the personal models


@pytest.mark.parametrize("method", [Ditto, MRMTL, APFL])
def test_the_personal_metric_is_the_personal_models(tmp_path, method):
    """Zeroing a client's kept personal classifier makes it predict one class: only its personal metrics change."""
    data = tiny_data(max_samples_per_client=200)  # enough to learn: site0's own model predicts several classes
    model = tiny_model(data, arch="mlp", width=32)
    fed = build_federation(tmp_path, callbacks=[method()], data=data, model=model, rounds=4)
    fed.run()
    before = fed.evaluate()["clients"]
    assert before["personal"]["site0"]["predicted_classes"] > 1
    kept = fed.transport.runtime.personal["site0"]["global"]
    for k in kept:
        if k.startswith("net.classifier."):
            kept[k].zero_()
    after = fed.evaluate()["clients"]
    assert after["personal"]["site0"]["predicted_classes"] == 1
    assert after["global"] == before["global"]
    assert after["personal"]["site1"] == before["personal"]["site1"]


def test_unselected_clients_keep_their_personal_model_and_the_rows_say_how_old(tmp_path):
    fed = build_federation(tmp_path, callbacks=[Ditto()], rounds=4, client_fraction=0.34, run_name="r")
    summary = fed.run()
    rows = list(csv.DictReader((tmp_path / "r" / "metrics.csv").open()))
    last_fit = {}
    for row in rows:
        r, cid = int(row["round"]), row["client"]
        if row["selected"] == "1":
            last_fit[cid] = r
        expected = "" if cid not in last_fit else str(r - last_fit[cid])
        assert row.get("personal_rounds_old", "") == expected, row
    on_disk = json.loads((tmp_path / "r" / "summary.json").read_text())
    for cid in last_fit:
        assert on_disk["clients"][cid]["personal_rounds_old"] == 4 - last_fit[cid]
        assert summary["clients"][cid]["personal_rounds_old"] == 4 - last_fit[cid]
    assert len(last_fit) < 3 or any(int(row["personal_rounds_old"] or 0) > 0 for row in rows)


def test_cross_site_scores_the_personal_models(tmp_path):
    fed = build_federation(tmp_path, callbacks=[Ditto(lam=0.0)], rounds=2, cross_site=True, run_name="x")
    fed.run()
    matrix = {}
    for row in csv.DictReader((tmp_path / "x" / "cross_site.csv").open()):
        if row["metric"] == "acc":
            matrix[(row["model"], row["test"])] = float(row["value"])
    own = fed.evaluate()["clients"]["personal"]
    for cid in tiny_data().client_ids:
        assert matrix[(cid, cid)] == pytest.approx(own[cid]["acc"])
