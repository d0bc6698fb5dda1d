"""FedDyn against a plain-PyTorch reference of its client and server updates, and its contract."""

import copy

import pytest
import torch
import torch.nn.functional as F

from callbacks import FedDyn
from fl_lightning.ops.feddyn import client_linear_update, server_h_update, server_model
from fl_lightning.server.selection import select_clients
from tests.conftest import build_federation, tiny_data, tiny_model

ALPHA, LR, ROUNDS = 0.05, 0.1, 3


def reference_feddyn(rounds: int, per_round: int, alpha: float, lr: float) -> tuple[dict, dict]:
    """FedDyn (Acar et al. 2021, Alg. 1) written out in plain PyTorch over the same batches and client samples."""
    data = tiny_data()
    module = tiny_model(data)
    ids = data.client_ids
    w = copy.deepcopy(module.state_dict())
    names = [k for k, _ in module.named_parameters()]
    h = {k: torch.zeros_like(w[k]) for k in names}
    g = {cid: {k: torch.zeros_like(w[k]) for k in names} for cid in ids}
    for r in range(rounds):
        selected = select_clients(ids, r, seed=0, k=per_round)
        states, delta = [], {k: torch.zeros_like(w[k]) for k in names}
        for cid in selected:
            module.load_state_dict(w)
            module.train()
            opt = torch.optim.SGD(module.parameters(), lr=lr)
            for x, y in data.client_train_loader(cid):
                opt.zero_grad()
                F.cross_entropy(module(x), y).backward()
                with torch.no_grad():
                    for k, p in module.named_parameters():
                        p.grad += alpha * (p - w[k]) - g[cid][k]
                opt.step()
            w_i = copy.deepcopy(module.state_dict())
            for k in names:
                g[cid][k] = g[cid][k] - alpha * (w_i[k] - w[k])
                delta[k] += w_i[k] - w[k]
            states.append(w_i)
        h = {k: h[k] - alpha * delta[k] / len(ids) for k in names}
        mean = {k: sum(s[k].double() for s in states) / len(states) for k in w if w[k].is_floating_point()}
        w = {**w, **{k: v.to(w[k].dtype) for k, v in mean.items()}}
        w = {**w, **{k: w[k] - h[k] / alpha for k in names}}
    return w, h


@pytest.mark.parametrize("per_round", [3, 2])
def test_feddyn_matches_the_plain_pytorch_reference(tmp_path, per_round):
    fed = build_federation(
        tmp_path, [FedDyn(alpha=ALPHA)], rounds=ROUNDS, aggregation="uniform", clients_per_round=per_round,
        model_kwargs={"lr": LR},
    )  # fmt: skip
    fed.run()
    want_w, want_h = reference_feddyn(ROUNDS, per_round, ALPHA, LR)
    got = fed.groups[0].state
    for k, v in want_w.items():
        if v.is_floating_point():
            torch.testing.assert_close(got[k], v, atol=2e-5, rtol=1e-4, msg=k)
    cb = next(c for c in fed.callbacks if isinstance(c, FedDyn))
    for k, v in want_h.items():
        torch.testing.assert_close(cb.h[k], v, atol=2e-6, rtol=1e-4, msg=k)
    assert any(v.abs().sum() > 0 for v in cb.h.values())  # the server state moved


def test_pure_updates_on_tiny_tensors():
    linear, local, received = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 5.0])}, {"w": torch.zeros(2)}
    assert torch.equal(client_linear_update(linear, local, received, 0.5)["w"], torch.tensor([-0.5, -0.5]))
    h = server_h_update({"w": torch.zeros(2)}, {"w": torch.tensor([2.0, 4.0])}, 0.5, 4)
    assert torch.equal(h["w"], torch.tensor([-0.25, -0.5]))
    out = server_model({"w": torch.ones(2), "b": torch.ones(1)}, h, 0.5)
    assert torch.equal(out["w"], torch.tensor([1.5, 2.0])) and torch.equal(out["b"], torch.ones(1))


def test_feddyn_sends_what_fedavg_sends(tmp_path):
    """Nothing travels beyond the model: the bytes of a round equal FedAvg's."""
    counts = []
    for callbacks in ([], [FedDyn(alpha=ALPHA)]):
        fed = build_federation(tmp_path / str(len(callbacks)), callbacks, rounds=1)
        fed.run()
        counts.append(
            {k: v for k, v in fed.run_dir.round_rows[-1].items() if k in ("comm/bytes_down", "comm/bytes_up")}
        )
    # equal up to the JSON header's float digits (the training loss, one number per reply)
    assert counts[0]["comm/bytes_down"] == counts[1]["comm/bytes_down"]
    assert abs(counts[0]["comm/bytes_up"] - counts[1]["comm/bytes_up"]) <= 8 * 3 and counts[0]["comm/bytes_up"] > 0


def test_alpha_must_be_positive():
    with pytest.raises(ValueError, match="alpha"):
        FedDyn(alpha=0.0)
