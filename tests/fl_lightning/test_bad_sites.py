"""A bad site does not stop the others: a reply that fails the server's checks is a failed client for that round,
exactly as a client whose fit raised, and the run stops only below ``federation.min_clients``."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from callbacks import FederatedCallback
from fl_lightning.server.reply_check import fit_reply_problem
from tests.conftest import build_federation, tiny_data
from tests.fl_lightning.test_modes import FailOn

MODEL = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "n": torch.zeros((), dtype=torch.int64)}


def problem(state=None, num_samples=4, num_steps=2, metrics=None, expected=tuple(MODEL)):
    state = {k: v.clone() for k, v in MODEL.items()} if state is None else state
    return fit_reply_problem(state, num_samples, num_steps, metrics or {"train_loss": 0.5}, MODEL, expected)


def test_a_well_formed_reply_passes_and_the_part_a_method_uploads_too():
    assert problem() is None
    assert problem({"w": torch.ones(2, 3)}, expected={"w"}) is None  # FedPer withholds its head
    assert problem({}, expected=set()) is None  # secure aggregation sends none of the model in the clear


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"state": [torch.zeros(3)]}, "its state is a list"),
        ({"state": {**MODEL, "extra": torch.zeros(1)}}, r"entries the method does not upload: \['extra'\]"),
        ({"state": {"w": torch.zeros(2, 3)}}, r"lacks entries the method uploads: \['b', 'n'\]"),
        ({"expected": {"w"}}, r"entries the method does not upload: \['b', 'n'\]"),  # e.g. FedPer's head sent
        ({"state": {**MODEL, "w": torch.zeros(3, 2)}}, r"'w' is torch.float32 \(3, 2\), the model's is torch.float32"),
        ({"state": {**MODEL, "b": torch.zeros(3, dtype=torch.float64)}}, "'b' is torch.float64"),
        ({"state": {**MODEL, "b": [0.0, 0.0, 0.0]}}, "'b' is a list, not a tensor"),
        ({"state": {**MODEL, "b": torch.tensor([0.0, float("nan"), 0.0])}}, "'b' holds non-finite values"),
        ({"state": {**MODEL, "w": torch.full((2, 3), float("inf"))}}, "'w' holds non-finite values"),
        ({"num_steps": -1}, "step count is -1"),
        ({"num_samples": 2.5}, "sample count is 2.5"),
        ({"num_steps": True}, "step count is True"),
        ({"metrics": {"train_loss": float("nan")}}, "training loss is nan"),
        ({"metrics": {"train_loss": "low"}}, "training loss is 'low'"),
    ],
)
def test_a_reply_that_would_poison_the_round_is_named(kwargs, match):
    found = problem(**kwargs)
    assert found is not None and __import__("re").search(match, found), found


class Corrupt(FederatedCallback):
    """The named clients' client half spoils the reply it uploads (after every check the client runtime makes)."""

    def __init__(self, client_ids, how):
        self.client_ids, self.how = set(client_ids), how

    def on_upload(self, ctx, reply):
        if ctx.client_id not in self.client_ids:
            return
        key = next(k for k, v in reply.state.items() if v.is_floating_point())
        if self.how == "nan":
            reply.state[key] = torch.full_like(reply.state[key], float("nan"))
        elif self.how == "shape":
            reply.state[key] = reply.state[key].reshape(-1)[:1]
        elif self.how == "extra":
            reply.state["not.in.the.model"] = torch.zeros(1)
        elif self.how == "missing":
            del reply.state[key]
        elif self.how == "steps":
            reply.num_steps = -3


def rounds_rows(summary) -> list[dict[str, str]]:
    with (Path(summary["run_dir"]) / "rounds.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("how", ["nan", "shape", "extra", "missing", "steps"])
def test_a_spoilt_reply_is_a_failed_client_like_one_whose_fit_raised(tmp_path, how):
    data = tiny_data(num_clients=3)
    spoilt = build_federation(tmp_path / "spoilt", [Corrupt({"site1"}, how)], data=data)
    with pytest.warns(UserWarning, match="client 'site1' failed .*its reply failed the server's checks"):
        summary = spoilt.run()
    assert [int(r["round/failed_clients"]) for r in rounds_rows(summary)] == [1, 1]
    raised = build_federation(tmp_path / "raised", [FailOn({"site1"})], data=tiny_data(num_clients=3))
    with pytest.warns(UserWarning, match="client 'site1' failed"):
        raised.run()
    for k, v in raised.groups[0].state.items():
        assert torch.equal(spoilt.groups[0].state[k], v), k


def test_what_a_method_takes_out_of_the_reply_is_not_a_failure_but_sending_it_is(tmp_path):
    from callbacks import FedPer

    data = tiny_data(num_clients=3)
    summary = build_federation(tmp_path / "fedper", [FedPer()], data=data).run()
    assert [int(r["round/failed_clients"]) for r in rounds_rows(summary)] == [0, 0]

    class SendsItsHead(FederatedCallback):  # after FedPer's on_upload: the head goes back in
        def on_client_end(self, ctx, module, reply):
            self.head = {k: v for k, v in reply.state.items() if k.startswith("net.classifier")}

        def on_upload(self, ctx, reply):
            if ctx.client_id == "site2":
                reply.state.update(self.head)

    fed = build_federation(tmp_path / "leaks", [FedPer(), SendsItsHead()], data=tiny_data(num_clients=3))
    with pytest.warns(UserWarning, match="client 'site2' failed .*entries the method does not upload: .*classifier"):
        summary = fed.run()
    assert [int(r["round/failed_clients"]) for r in rounds_rows(summary)] == [1, 1]


@pytest.mark.parametrize("topology", ["star", "cyclic"])
def test_the_run_stops_when_fewer_than_min_clients_replied(tmp_path, topology):
    fed = build_federation(
        tmp_path / "three", [FailOn({"site1"})], data=tiny_data(num_clients=3), min_clients=3, topology=topology
    )
    with (
        pytest.warns(UserWarning, match="client 'site1' failed"),
        pytest.raises(
            RuntimeError,
            match=r"round 1: only 2 of the 3 selected clients .*min_clients asks for 3; "
            r"failed: \['site1'\]",
        ),  # fmt: skip
    ):
        fed.run()
    fed = build_federation(
        tmp_path / "two", [FailOn({"site1"})], data=tiny_data(num_clients=3), min_clients=2, topology=topology
    )
    with pytest.warns(UserWarning, match="client 'site1' failed"):
        summary = fed.run()
    assert [int(r["round/failed_clients"]) for r in rounds_rows(summary)] == [1, 1]


def test_min_clients_above_the_selection_asks_for_all_selected(tmp_path):
    # two of three clients per round: min_clients=3 means "every selected one", not "more than were asked"
    summary = build_federation(tmp_path, data=tiny_data(num_clients=3), min_clients=3, clients_per_round=2).run()
    assert [int(r["selected"]) for r in rounds_rows(summary)] == [2, 2]


def test_min_clients_and_reply_timeout_are_checked():
    from fl_lightning.config import FederationConfig

    with pytest.raises(ValueError, match=r"federation.min_clients=0.*federation.reply_timeout=-1"):
        FederationConfig(min_clients=0, reply_timeout=-1)
