"""FedALA: the adaptive local aggregation against an autograd reference, its limits and its evaluation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from callbacks import FedALA
from datamodules.sampler import SeededEpochSampler, stable_seed
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.fedala import ala_mix, ala_weight_step, converged
from tests.conftest import build_federation, reference_sgd, tiny_data, tiny_model

ATOL = 1e-5
HEAD = ("classifier.weight", "classifier.bias")  # the tiny CNN's last nn.Linear, what FedALA finds


# ---------------------------------------------------------------- the pure parts


def test_ala_mix_is_exact_at_both_ends_and_linear_between():
    torch.manual_seed(0)
    own, received = torch.randn(50), torch.randn(50)
    assert torch.equal(ala_mix([own], [received], [torch.ones(50)])[0], received)
    assert torch.equal(ala_mix([own], [received], [torch.zeros(50)])[0], own)
    w = torch.rand(50)
    torch.testing.assert_close(ala_mix([own], [received], [w])[0], own + (received - own) * w)


def test_ala_weight_step_is_the_autograd_derivative_and_stays_in_0_1():
    torch.manual_seed(0)
    own, received, x = torch.randn(5, 3), torch.randn(5, 3), torch.randn(4, 5)
    w = torch.rand(5, 3, dtype=torch.float64, requires_grad=True)
    (x.double() @ (own.double() + (received.double() - own.double()) * w)).pow(2).sum().backward()
    at_mix = ala_mix([own], [received], [w.detach().float()])[0].requires_grad_()
    (x @ at_mix).pow(2).sum().backward()
    new = ala_weight_step([w.detach().float()], [at_mix.grad], [own], [received], eta=1e-3)[0]
    torch.testing.assert_close(new, torch.clamp(w.detach() - 1e-3 * w.grad, 0, 1).float(), rtol=1e-5, atol=1e-6)
    big = ala_weight_step([w.detach().float()], [at_mix.grad], [own], [received], eta=1e6)[0]
    assert set(big.unique().tolist()) <= {0.0, 1.0}
    kept = torch.full((2,), 0.3)
    assert torch.equal(ala_weight_step([kept], [None], [torch.ones(2)], [torch.zeros(2)], eta=1.0)[0], kept)


def test_converged_needs_more_than_a_window_of_steady_losses():
    assert not converged([1.0, 1.0], window=2, threshold=0.1)  # not more than the window yet
    assert converged([5.0, 1.0, 1.05], window=2, threshold=0.1)
    assert not converged([5.0, 1.0, 2.0], window=2, threshold=0.1)


# ---------------------------------------------------------------- the method


def test_eta_zero_keeps_the_weights_at_one_and_the_global_model_is_fedavgs_bit_for_bit(tmp_path):
    fedavg = build_federation(tmp_path / "a", rounds=3)
    fedavg.run()
    ala = build_federation(tmp_path / "b", callbacks=[FedALA(eta=0.0)], rounds=3)
    ala.run()
    for k, v in fedavg.groups[0].state.items():
        assert torch.equal(ala.groups[0].state[k], v), k
    for cid, states in ala.transport.runtime.callback_states.items():
        assert all(torch.equal(w, torch.ones_like(w)) for w in states["FedALA"]["weights"].values()), cid


def _ala_reference(data, cid, own, received, passes, eta):
    """One adaptation written out: W a leaf, θ̂ = θ + (Θ − θ) W through ``functional_call``, W stepped by autograd."""
    net = tiny_model(data).net
    n = data.num_train_samples(cid)
    size = int(n * 0.8)
    seed = stable_seed(0, "FedALA", "sample", cid, 1)
    indices = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size]
    loader = data.client_subset_train_loader(cid, indices, SeededEpochSampler(size, seed))
    weights = {k: torch.ones_like(own[k]) for k in HEAD}
    statistics = {k: v.clone() for k, v in received.items() if k not in dict(net.named_parameters())}
    for _ in range(passes):
        for x, y in loader:
            leaves = {k: w.clone().requires_grad_() for k, w in weights.items()}
            mixed = {k: own[k] + (received[k] - own[k]) * leaves[k] for k in HEAD}
            params = {k: received[k] for k, _ in net.named_parameters() if k not in HEAD}
            out = functional_call(net.train(), {**params, **mixed, **statistics}, (x,))
            grads = torch.autograd.grad(F.cross_entropy(out, y), list(leaves.values()))
            weights = {k: torch.clamp(weights[k] - eta * g, 0, 1) for k, g in zip(leaves, grads)}
    start = {**received, **{k: own[k] + (received[k] - own[k]) * weights[k] for k in HEAD}}
    return weights, start


@pytest.mark.parametrize("eta", [1.0, 20.0])
def test_the_second_round_matches_an_autograd_reference(tmp_path, eta):
    """Round 1 is FedAvg; round 2 adapts each client's head from its round-1 model (3 passes: the window is 2 and
    the threshold is never missed), then trains the adapted start on the client's usual batches."""
    data = tiny_data()
    fedavg = build_federation(tmp_path / "avg", rounds=1)
    fedavg.run()
    received = {k[len("net.") :]: v for k, v in fedavg.groups[0].state.items() if k.startswith("net.")}
    fed = build_federation(tmp_path / "ala", callbacks=[FedALA(eta=eta, window=2, threshold=1e9)], rounds=2)
    fed.run()
    for cid in data.client_ids:
        loader = data.client_train_loader(cid)
        own = reference_sgd(tiny_model(data).net, [loader], lr=0.1)  # round 1
        weights, start = _ala_reference(data, cid, own, received, passes=3, eta=eta)
        net = copy.deepcopy(tiny_model(data).net)
        net.load_state_dict(start)
        trained = reference_sgd(net, [loader], lr=0.1)  # round 2: the loader's second pass
        state = fed.transport.runtime.callback_states[cid]["FedALA"]
        assert state["passes"] == 3
        for k in HEAD:
            torch.testing.assert_close(state["weights"][f"net.{k}"], weights[k], rtol=0, atol=ATOL, msg=k)
        kept = fed.transport.runtime.personal[cid]["global"]
        for k, v in trained.items():
            torch.testing.assert_close(kept[f"net.{k}"], v, rtol=0, atol=ATOL, msg=k)
        moved = [k for k in HEAD if not torch.allclose(weights[k], torch.ones_like(weights[k]))]
        assert moved, "the reference must move the weights, or it checks nothing"


def test_the_first_adaptation_stops_at_its_cap_and_later_ones_make_one_pass(tmp_path):
    fed = build_federation(tmp_path, callbacks=[FedALA(threshold=0.0, max_first_passes=4)], rounds=2)
    fed.run()
    assert {s["FedALA"]["passes"] for s in fed.transport.runtime.callback_states.values()} == {4}
    fed = build_federation(tmp_path / "3", callbacks=[FedALA(threshold=0.0, max_first_passes=4)], rounds=3)
    fed.run()
    assert {s["FedALA"]["passes"] for s in fed.transport.runtime.callback_states.values()} == {1}


def test_the_personal_metric_is_the_clients_trained_model(tmp_path):
    data = tiny_data(max_samples_per_client=200)
    model = tiny_model(data, arch="mlp", width=32)
    fed = build_federation(tmp_path, callbacks=[FedALA()], data=data, model=model, rounds=4)
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


def test_bad_arguments_and_a_changed_head_are_refused(tmp_path):
    for kwargs in ({"eta": -1.0}, {"sample_fraction": 0.0}, {"sample_fraction": 1.5}, {"window": 0}):
        with pytest.raises(ValueError, match="FedALA"):
            FedALA(**kwargs)
    with pytest.raises(ValueError, match=r"head=\['nope'\] names no module"):
        build_federation(tmp_path / "h", callbacks=[FedALA(head=["nope"])], rounds=1).run()
    fed = build_federation(tmp_path / "r", callbacks=[FedALA()], rounds=2)
    fed.run()
    for states in fed.transport.runtime.callback_states.values():
        states["FedALA"]["weights"] = {"net.features.9.weight": torch.ones(1)}
    with pytest.raises(PreconditionError, match=r"kept weights are for \['net.features.9.weight'\]"):
        fed.run_round(2)
