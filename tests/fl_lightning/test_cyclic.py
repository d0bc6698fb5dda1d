"""Cyclic weight transfer (federation.topology: cyclic) against a hand-written cycle, its order, its refusals."""

import pytest
import torch

from callbacks import FedProx, Scaffold
from fl_lightning import FederationConfig
from fl_lightning.server.cyclic import cycle_order
from tests.conftest import build_federation, reference_sgd, tiny_data, tiny_model


def _net_state(state):
    return {k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")}


def _hand_cycle(rounds, order_kind, mu=0.0):
    """The cycle written out: each client trains the previous one's weights on its batches of that round."""
    data = tiny_data()
    net = tiny_model(data).net
    ids = list(data.client_ids)
    passes = {c: [list(data.client_train_loader(c)) for _ in range(rounds)] for c in ids}
    for r in range(rounds):
        for cid in cycle_order(ids, r, 0, order_kind):
            net.load_state_dict(reference_sgd(net, [passes[cid][r]], lr=0.1, mu=mu))
    return net.state_dict()


@pytest.mark.parametrize("order_kind", ["random", "fixed"])
def test_cycle_equals_the_hand_written_cycle(tmp_path, order_kind):
    fed = build_federation(tmp_path, rounds=3, topology="cyclic", cycle_order=order_kind)
    summary = fed.run()
    expected = _hand_cycle(3, order_kind)
    got = _net_state(fed.groups[0].state)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6, msg=k)
    assert summary["summary"]["global"]["acc"]["mean"] >= 0  # the cycle's model is evaluated as the global one


def test_cycle_differs_from_fedavg_and_from_another_order(tmp_path):
    """Passing the model on is not averaging, and the visiting order matters (so the test above can fail)."""
    avg = build_federation(tmp_path / "avg", rounds=2)
    avg.run()
    fixed, rand = _hand_cycle(2, "fixed"), _hand_cycle(2, "random")
    got = _net_state(avg.groups[0].state)
    assert any(not torch.allclose(got[k], fixed[k]) for k in fixed)
    orders = [cycle_order(["a", "b", "c", "d"], r, 0, "random") for r in range(6)]
    assert len({tuple(o) for o in orders}) > 1  # a fresh permutation per round
    assert all(sorted(o) == ["a", "b", "c", "d"] for o in orders)
    assert orders == [cycle_order(["a", "b", "c", "d"], r, 0, "random") for r in range(6)]  # seeded: resumable
    if cycle_order(list(tiny_data().client_ids), 0, 0, "random") != list(tiny_data().client_ids):
        assert any(not torch.allclose(fixed[k], rand[k]) for k in fixed)


def test_cycle_with_fedprox_pulls_towards_the_received_model(tmp_path):
    fed = build_federation(tmp_path, callbacks=[FedProx(mu=0.5)], rounds=2, topology="cyclic", cycle_order="fixed")
    fed.run()
    expected = _hand_cycle(2, "fixed", mu=0.5)
    got = _net_state(fed.groups[0].state)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6, msg=k)


def test_cycle_resumes_to_the_uninterrupted_state(tmp_path):
    whole = build_federation(tmp_path / "whole", rounds=3, topology="cyclic", run_name="w")
    whole.run()
    first = build_federation(tmp_path / "part", rounds=2, topology="cyclic", run_name="p")
    first.run()
    rest = build_federation(tmp_path / "part", rounds=3, topology="cyclic", run_name="p", resume="last")
    rest.run()
    for k, v in whole.groups[0].state.items():
        assert torch.equal(rest.groups[0].state[k], v), k


def test_cycle_refuses_methods_with_a_server_step(tmp_path):
    with pytest.raises(ValueError, match=r"topology=cyclic .*Scaffold \(.*on_aggregate"):
        build_federation(tmp_path, callbacks=[Scaffold()], topology="cyclic")


def test_cycle_needs_federated_mode():
    with pytest.raises(ValueError, match="topology=cyclic needs federation.mode=federated"):
        FederationConfig(topology="cyclic", mode="local")
