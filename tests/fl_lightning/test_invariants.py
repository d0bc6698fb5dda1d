"""Invariants of ../shared/ALGORITHMS.md for FedAvg, FedProx and FedBN, against independent references."""

import pytest
import torch
from torch import nn

from callbacks import FedBN, FederatedCallback, FedProx
from fl_lightning.ops import aggregation_weights
from tests.conftest import build_federation, reference_sgd, tiny_data, tiny_model


def assert_same_state(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def client_batches(data_kwargs, client_id, rounds, pooled=False):
    """The batches a client draws in each round, from a fresh datamodule with the same seed."""
    data = tiny_data(**data_kwargs)
    loader = (lambda: data.pooled_train_loader()) if pooled else (lambda: data.client_train_loader(client_id))
    return [list(loader()) for _ in range(rounds)]


def test_fedavg_with_one_client_is_plain_training(tmp_path):
    data = tiny_data(num_clients=1)
    fed = build_federation(tmp_path, data=data, rounds=3)
    init = tiny_model(data).net
    fed.run()
    expected = reference_sgd(init, client_batches({"num_clients": 1}, "site0", 3), lr=0.1)
    got = {k.removeprefix("net."): v for k, v in fed.groups[0].state.items() if k.startswith("net.")}
    assert_same_state(got, expected, atol=1e-6)


def test_centralized_mode_is_plain_training_on_pooled_data(tmp_path):
    data = tiny_data(num_clients=3)
    fed = build_federation(tmp_path, data=data, rounds=2, mode="centralized", model_kwargs={"momentum": 0.9})
    init = tiny_model(data).net
    fed.run()
    batches = client_batches({"num_clients": 3}, None, 2, pooled=True)
    # Centralised training keeps its optimiser (momentum) across rounds, like one long fit.
    expected = reference_sgd(init, batches, lr=0.1, momentum=0.9, fresh_optimizer_each_round=False)
    got = {k.removeprefix("net."): v for k, v in fed.groups[0].state.items() if k.startswith("net.")}
    assert_same_state(got, expected, atol=1e-5)


def test_fedprox_mu_zero_equals_fedavg(tmp_path):
    plain = build_federation(tmp_path / "a", rounds=2, model_kwargs={"momentum": 0.9})
    prox = build_federation(tmp_path / "b", [FedProx(mu=0.0)], rounds=2, model_kwargs={"momentum": 0.9})
    plain.run(), prox.run()
    assert_same_state(plain.groups[0].state, prox.groups[0].state)


def test_fedprox_matches_a_hand_written_proximal_loop(tmp_path):
    data = tiny_data(num_clients=1)
    fed = build_federation(tmp_path, [FedProx(mu=0.5)], data=data, rounds=2)
    init = tiny_model(data).net
    fed.run()
    expected = reference_sgd(init, client_batches({"num_clients": 1}, "site0", 2), lr=0.1, mu=0.5)
    got = {k.removeprefix("net."): v for k, v in fed.groups[0].state.items() if k.startswith("net.")}
    assert_same_state(got, expected, atol=1e-6)
    without = reference_sgd(init, client_batches({"num_clients": 1}, "site0", 2), lr=0.1, mu=0.0)
    assert not torch.allclose(got["classifier.weight"], without["classifier.weight"])  # the term does something


def test_fedbn_without_norm_layers_equals_fedavg(tmp_path):
    kwargs = {"norm": "none"}
    plain = build_federation(tmp_path / "a", model_kwargs=kwargs)
    fedbn = build_federation(tmp_path / "b", [FedBN()], model_kwargs=kwargs)
    plain.run()
    with pytest.warns(UserWarning, match="FedBN found no normalisation layer"):  # said, not silent
        fedbn.run()
    assert fedbn.transport.runtime.private_keys == set()
    assert_same_state(plain.groups[0].state, fedbn.groups[0].state)


class OddlyNamedNet(nn.Module):
    """Norm layers under names that do not say 'bn', and a linear layer that does."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.foo = nn.BatchNorm2d(4)
        self.inorm_by_another_name = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.bn = nn.Linear(4, 10)

    def forward(self, x):
        return self.bn(self.pool(torch.relu(self.inorm_by_another_name(self.foo(self.conv(x))))).flatten(1))


class UploadRecorder(FederatedCallback):
    def __init__(self):
        self.uploads = {}

    def on_client_end(self, ctx, module, update):
        client_id = ctx.client_id
        self.uploads[client_id] = (update.state, update.num_samples)


def test_fedbn_keeps_every_norm_layer_local_whatever_its_name(tmp_path):
    data = tiny_data(num_clients=3)
    model = tiny_model(data)
    model.net = OddlyNamedNet()
    recorder = UploadRecorder()
    fed = build_federation(tmp_path, [FedBN(), recorder], data=data, model=model, rounds=2)
    fed.run()
    norm_keys = {k for k in fed.groups[0].state if k.startswith(("net.foo.", "net.inorm_by_another_name."))}
    assert fed.transport.runtime.private_keys == norm_keys and "net.bn.weight" not in fed.transport.runtime.private_keys
    assert {"net.foo.running_mean", "net.foo.weight", "net.inorm_by_another_name.running_var"} <= norm_keys
    # Each client keeps exactly what it trained, and clients differ (their data differ in style).
    for cid, (state, _) in recorder.uploads.items():
        for k in norm_keys:
            assert torch.equal(fed.transport.private[("global", cid)][k], state[k])
    a, b = (fed.transport.private[("global", c)]["net.foo.running_mean"] for c in ("site0", "site2"))
    assert not torch.allclose(a, b)
    # The shared part is the sample-weighted average of the uploads, computed here by hand.
    states, counts = zip(*recorder.uploads.values())
    p = [n / sum(counts) for n in counts]
    for k in ("net.conv.weight", "net.bn.weight", "net.bn.bias"):
        torch.testing.assert_close(fed.groups[0].state[k], sum(pi * s[k] for pi, s in zip(p, states)))
    # A client is trained and evaluated with its own norm layers: personalised results exist for every client.
    assert set(fed.evaluate()["clients"]["personal"]) == set(data.client_ids)


def test_uniform_aggregation_weights(tmp_path):
    data = tiny_data(num_clients=3, partition="dirichlet", alpha=0.5)
    recorder = UploadRecorder()
    fed = build_federation(tmp_path, [recorder], data=data, rounds=1, aggregation="uniform")
    fed.run()
    states = [s for s, _ in recorder.uploads.values()]
    assert aggregation_weights([n for _, n in recorder.uploads.values()], "uniform") == [1 / 3] * 3
    torch.testing.assert_close(
        fed.groups[0].state["net.classifier.weight"], sum(s["net.classifier.weight"] for s in states) / 3
    )
