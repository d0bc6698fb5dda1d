"""FedPer and LG-FedAvg: which part stays, what leaves, against plain-PyTorch references; the head rule."""

import pytest
import torch
from torch import nn

from callbacks import FederatedCallback, FedPer, LGFedAvg
from callbacks.head_body.heads import head_modules
from fl_lightning.clients.tabular import TabularClient
from tests.conftest import build_federation, reference_sgd, tiny_data, tiny_model

HEAD = "net.classifier."


class Uploads(FederatedCallback):
    """Records the keys of every fit reply the server receives."""

    def __init__(self):
        super().__init__()
        self.keys = []

    def on_reply(self, server, task, reply, weight):
        self.keys.append(set(reply.state))


def _client_reference(data, cid, rounds=1):
    """The client's whole model trained alone from the initial weights on its batches (a plain SGD loop)."""
    template = tiny_model(data)
    batches = [list(data.client_train_loader(cid)) for _ in range(rounds)]
    net = reference_sgd(template.net, batches, lr=0.1)
    return {f"net.{k}": v for k, v in net.items()}


def test_the_head_is_found_or_named_and_an_ambiguous_one_refused():
    data = tiny_data()
    assert head_modules(tiny_model(data)) == ["net.classifier"]
    assert head_modules(TabularClient(num_features=5)) == ["net.classifier.linear"]
    ambiguous = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"ambiguous; name the head's modules with head"):
        head_modules(ambiguous, method="FedPer")
    assert head_modules(ambiguous, ["0"]) == ["0"]
    with pytest.raises(ValueError, match=r"head=\['nope'\] names no module"):
        head_modules(ambiguous, ["nope"], "FedPer")


def test_fedper_keeps_each_head_home_and_averages_the_bodies(tmp_path):
    spy = Uploads()
    fed = build_federation(tmp_path, callbacks=[FedPer(), spy], rounds=1)
    init = {k: v.clone() for k, v in tiny_model(tiny_data()).state_dict().items()}
    fed.run()
    data = tiny_data()
    ids = list(data.client_ids)
    refs = {c: _client_reference(data, c) for c in ids}
    n = {c: data.num_train_samples(c) for c in ids}
    # no upload holds a head weight
    assert spy.keys and all(not any(k.startswith(HEAD) for k in keys) for keys in spy.keys)
    state = fed.groups[0].state
    for k, v in state.items():
        if k.startswith(HEAD):
            assert torch.equal(v, init[k]), k  # the global head is the initial one
        elif v.is_floating_point() and k in refs[ids[0]]:
            mean = sum(refs[c][k].double() * n[c] for c in ids) / sum(n.values())
            torch.testing.assert_close(v.double(), mean, rtol=0, atol=1e-6, msg=k)
    private = fed.transport.runtime.private
    for c in ids:  # each client keeps its own trained head
        for k, v in private[c]["global"].items():
            torch.testing.assert_close(v, refs[c][k], rtol=0, atol=1e-6, msg=(c, k))


def test_a_personal_metric_uses_the_clients_own_head(tmp_path):
    """A client whose personal head is zeroed predicts class 0 everywhere: its personal accuracy is class 0's share."""
    data = tiny_data(max_samples_per_client=200)  # enough to learn: site0's own model predicts several classes
    fed = build_federation(tmp_path, callbacks=[FedPer()], data=data, model=tiny_model(data, arch="mlp", width=32),
                           rounds=4)  # fmt: skip
    fed.run()
    before = fed.evaluate()["clients"]["personal"]
    cid = "site0"
    assert before[cid]["predicted_classes"] > 1
    head = fed.transport.runtime.private[cid]["global"]
    for k in head:
        head[k] = torch.zeros_like(head[k])
    after = fed.evaluate()["clients"]["personal"]
    labels = data.client_data(cid).test_y
    assert after[cid]["acc"] == pytest.approx(float((labels == 0).double().mean()), abs=1e-12)
    assert after[cid]["predicted_classes"] == 1.0 and before[cid]["acc"] != after[cid]["acc"]
    assert all(after[c] == before[c] for c in before if c != cid)  # the others keep theirs


def test_fedper_with_one_client_is_local_training(tmp_path):
    data = tiny_data(num_clients=1)
    fed = build_federation(tmp_path, data=data, callbacks=[FedPer()], rounds=2)
    fed.run()
    ref = _client_reference(tiny_data(num_clients=1), "site0", rounds=2)  # fresh samplers: the same batches
    personal = {**fed.groups[0].state, **fed.transport.runtime.private["site0"]["global"]}
    for k, v in ref.items():
        torch.testing.assert_close(personal[k], v, rtol=0, atol=1e-6, msg=k)


def test_lg_fedavg_shares_only_the_head(tmp_path):
    spy = Uploads()
    fed = build_federation(tmp_path, callbacks=[LGFedAvg(), spy], rounds=1)
    init = tiny_model(tiny_data()).state_dict()
    fed.run()
    data = tiny_data()
    ids = list(data.client_ids)
    refs = {c: _client_reference(data, c) for c in ids}
    n = {c: data.num_train_samples(c) for c in ids}
    assert spy.keys and all(keys and all(k.startswith(HEAD) for k in keys) for keys in spy.keys)
    for k, v in fed.groups[0].state.items():
        if k.startswith(HEAD):
            mean = sum(refs[c][k].double() * n[c] for c in ids) / sum(n.values())
            torch.testing.assert_close(v.double(), mean, rtol=0, atol=1e-6, msg=k)
        else:
            assert torch.equal(v, init[k]), k  # the global body is the initial one: bodies never leave
    for c in ids:
        kept = fed.transport.runtime.private[c]["global"]
        assert kept and not any(k.startswith(HEAD) for k in kept)


def _fedrep_reference(data, cid, rounds, head_epochs, body_epochs):
    """FedRep's fit written out: per round a fresh SGD; head epochs with the body's gradients dropped, then body
    epochs with the head's dropped (a frozen part takes no step)."""
    net = tiny_model(data).net
    opt_params = list(net.named_parameters())
    loader = data.client_train_loader(cid)
    for _ in range(rounds):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for epoch in range(head_epochs + body_epochs):
            train_head = epoch < head_epochs
            for x, y in loader:
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(net(x), y).backward()
                for name, p in opt_params:
                    if name.startswith("classifier.") != train_head:
                        p.grad = None
                opt.step()
    return {f"net.{k}": v for k, v in net.state_dict().items()}


@pytest.mark.parametrize("head_epochs", [1, 2])
def test_fedrep_with_one_client_trains_the_head_then_the_body(tmp_path, head_epochs):
    from callbacks import FedRep

    data = tiny_data(num_clients=1)
    fed = build_federation(tmp_path, data=data, callbacks=[FedRep(head_epochs=head_epochs)], rounds=2)
    fed.run()
    ref = _fedrep_reference(tiny_data(num_clients=1), "site0", 2, head_epochs, 1)
    personal = {**fed.groups[0].state, **fed.transport.runtime.private["site0"]["global"]}
    for k, v in ref.items():
        torch.testing.assert_close(personal[k], v, rtol=0, atol=1e-6, msg=k)
    module = fed.module
    assert all(p.requires_grad for p in module.parameters())  # every flag restored after the fit


def test_fedrep_without_head_epochs_never_trains_the_head_and_refuses_local_steps(tmp_path):
    from callbacks import FedRep

    init = tiny_model(tiny_data()).state_dict()
    rep = build_federation(tmp_path / "rep", callbacks=[FedRep(head_epochs=0)], rounds=2)
    rep.run()
    for cid, held in rep.transport.runtime.private.items():
        for k, v in held["global"].items():
            assert torch.equal(v, init[k]), (cid, k)
    assert any(not torch.equal(rep.groups[0].state[k], init[k]) for k in init if not k.startswith(HEAD))
    with pytest.raises(ValueError, match="FedRep trains its head and its body in epochs"):
        build_federation(tmp_path / "steps", callbacks=[FedRep()], rounds=1, local_steps=2).run()


def test_fedbabu_keeps_the_initial_head_and_trains_the_body_alone(tmp_path):
    from callbacks import FedBABU

    data = tiny_data(num_clients=1)
    fed = build_federation(tmp_path, data=data, callbacks=[FedBABU()], rounds=2)
    init = tiny_model(data).state_dict()
    fed.run()
    # the reference: FedRep's loop with no head epoch trains only the body
    ref = _fedrep_reference(tiny_data(num_clients=1), "site0", 2, head_epochs=0, body_epochs=1)
    state = fed.groups[0].state
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6, msg=k)
    for k in init:
        if k.startswith(HEAD):
            assert torch.equal(state[k], init[k]), k  # bit for bit: never trained, never averaged
    assert all(p.requires_grad for p in fed.module.parameters())


def test_fedbabu_with_fine_tuning_personalises_the_head_at_the_end(tmp_path):
    from callbacks import FedBABU, LocalFineTuning

    spy = Uploads()
    fed = build_federation(tmp_path, callbacks=[FedBABU(), LocalFineTuning(epochs=2), spy], rounds=2)
    summary = fed.run()
    assert spy.keys and all(not any(k.startswith(HEAD) for k in keys) for keys in spy.keys)
    finetuned, glob = summary["clients"], summary["summary"]
    assert "finetuned" in glob and glob["finetuned"]["loss"]["mean"] < glob["global"]["loss"]["mean"]
    assert all("finetuned" in m for m in finetuned.values())
