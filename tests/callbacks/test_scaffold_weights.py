"""SCAFFOLD's server control update under sample-weighted aggregation of unequal clients (issue 15).

With p_i = n_i/n and unequal local steps τ_i, the paper's c ← c + Σ Δc_i / N makes c the plain mean of the c_i,
while the aggregated update follows Σ_i p_i τ_i (ḡ_i + c − c_i): the corrections no longer cancel, and on a
Dirichlet(0.1) split the large client walked τ_i steps along the small clients' one-batch gradients until the run
diverged (experiments/degenerate.py). The default now weights the control update by p_i τ_i.
"""

from __future__ import annotations

import pytest
import torch

from callbacks import FederatedCallback, Scaffold
from tests.conftest import build_federation, reference_scaffold, tiny_data


class Controls(FederatedCallback):
    """Server side, listed after Scaffold: each reply's Δc_i, τ_i and n_i."""

    def __init__(self, scaffold: Scaffold) -> None:
        self.scaffold = scaffold
        self.replies: list[tuple[str, int, dict[str, torch.Tensor]]] = []

    def on_reply(self, server, task, reply, weight):
        delta = self.scaffold.get_payload(reply)
        self.replies.append((task.client_id, reply.num_steps, {k: v.clone() for k, v in delta.items()}))


def unequal_data():
    # 741 / 364 / 333 training samples: 93 / 46 / 42 steps of batch 8
    return tiny_data(num_clients=3, max_samples_per_client=None, partition="dirichlet", alpha=0.3)


def test_corrections_cancel_in_the_sample_weighted_update(tmp_path):
    data = unequal_data()
    scaffold = Scaffold()
    recorder = Controls(scaffold)
    fed = build_federation(tmp_path, [scaffold, recorder], data=data, rounds=1, model_kwargs={"lr": 0.05})
    fed.run()
    n = {cid: data.num_train_samples(cid) for cid in data.client_ids}
    steps = {cid: tau for cid, tau, _ in recorder.replies}
    assert len(set(steps.values())) == 3  # the case that matters: unequal τ_i
    total = sum(n.values())
    pi = {cid: n[cid] / total * steps[cid] for cid in n}
    c = scaffold.c
    for k in c:
        # round 1: c_i starts at 0, so Δc_i = c_i⁺; the aggregate's correction Σ_i p_i τ_i (c − c_i) vanishes
        drift = sum(pi[cid] * (c[k] - delta[k]) for cid, _, delta in recorder.replies)
        scale = sum(pi[cid] * delta[k].abs() for cid, _, delta in recorder.replies).max()
        assert float(drift.abs().max()) <= 1e-5 * float(scale) + 1e-7, k
    assert any(v.abs().max() > 0 for v in c.values())


def test_uniform_control_weights_are_the_paper_update(tmp_path):
    data = unequal_data()
    scaffold = Scaffold(control_weights="uniform")
    recorder = Controls(scaffold)
    build_federation(tmp_path, [scaffold, recorder], data=data, rounds=1, model_kwargs={"lr": 0.05}).run()
    for k, v in scaffold.c.items():
        expected = sum(delta[k] for _, _, delta in recorder.replies) / 3
        torch.testing.assert_close(v, expected)


@pytest.mark.parametrize("weights", ["steps", "aggregation", "uniform"])
def test_equal_clients_reduce_to_the_paper(tmp_path, weights):
    # equal n_i and τ_i, 2 of 3 clients per round: every weighting is c ← c + Σ_{i∈S} Δc_i / N
    fed = build_federation(tmp_path, [Scaffold(control_weights=weights)], rounds=3, clients_per_round=2)
    fed.run()
    w, c = reference_scaffold(rounds=3, per_round=2, lrs=[0.1] * 3)
    for k in c:
        torch.testing.assert_close(fed.callbacks[0].c[k], c[k], rtol=0, atol=1e-4)


def test_unknown_control_weights_are_refused():
    with pytest.raises(ValueError, match="control_weights"):
        Scaffold(control_weights="samples")
