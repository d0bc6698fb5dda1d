"""Modes and round mechanics of the Federation: local, peer-to-peer, sampling, failures, run directory, seeds."""

import csv
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from callbacks import FederatedCallback
from fl_lightning.ops import clone_state
from fl_lightning.server.selection import random_cycle, select_clients
from tests.conftest import build_federation, reference_sgd, tiny_data, tiny_model


def assert_same_state(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def assert_equal_state(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class Recorder(FederatedCallback):
    """What each client starts from and uploads, per round."""

    def __init__(self):
        self.round = None
        self.starts = {}  # (round, client) -> state loaded before the local fit
        self.uploads = {}  # (round, client) -> (uploaded state, num_samples)
        self.trained = defaultdict(list)  # round -> clients in training order

    def on_round_start(self, federation, round_idx, selected):
        self.round = round_idx

    def on_client_start(self, ctx, module):
        client_id = ctx.client_id
        self.starts[(self.round, client_id)] = clone_state(module.state_dict())
        self.trained[self.round].append(client_id)

    def on_client_end(self, ctx, module, update):
        client_id = ctx.client_id
        self.uploads[(self.round, client_id)] = (clone_state(update.state), update.num_samples)


# ------------------------------------------------------------------------------------------------ local mode


def test_local_mode_clients_train_alone(tmp_path):
    rounds, data = 3, tiny_data(num_clients=3)
    fed = build_federation(tmp_path, data=data, rounds=rounds, mode="local", model_kwargs={"momentum": 0.9})
    init_module, evaluator = tiny_model(data, momentum=0.9), tiny_model(data)
    summary = fed.run()

    assert set(summary["summary"]) == {"personal"}
    assert "pooled" not in summary
    assert all(set(c) == {"test_samples", "personal", "personal_rounds_old"} for c in summary["clients"].values())
    assert all(c["personal_rounds_old"] == 0 for c in summary["clients"].values())  # every client trained last round
    # No server step ever ran: the group's state is still the initial model.
    assert_equal_state(fed.groups[0].state, init_module.state_dict())

    fresh = tiny_data(num_clients=3)
    for cid in data.client_ids:
        batches = [list(fresh.client_train_loader(cid)) for _ in range(rounds)]
        # local mode keeps the optimiser (momentum) across rounds: one long fit of the client alone
        expected = reference_sgd(init_module.net, batches, lr=0.1, momentum=0.9, fresh_optimizer_each_round=False)
        got = {
            k.removeprefix("net."): v for k, v in fed.transport.private[("global", cid)].items() if k.startswith("net.")
        }
        assert_same_state(got, expected, atol=1e-5)
        # ...and each client is evaluated with that model of its own
        evaluator.net.load_state_dict(expected)
        metrics = evaluator.evaluate(data.client_test_loader(cid), torch.device("cpu"))
        for name, value in metrics.items():
            assert summary["clients"][cid]["personal"][name] == pytest.approx(value, abs=1e-4), (cid, name)
    a, b = (fed.transport.private[("global", c)]["net.classifier.weight"] for c in ("site0", "site1"))
    assert not torch.allclose(a, b)


def test_local_mode_refuses_federated_callbacks(tmp_path):
    with pytest.raises(ValueError, match="Recorder"):
        build_federation(tmp_path, [Recorder()], mode="local")


# ------------------------------------------------------------------------------------------------ peer to peer


def test_peer_to_peer_passes_each_model_to_its_successor(tmp_path):
    rounds, data = 3, tiny_data(num_clients=4)
    recorder = Recorder()
    fed = build_federation(tmp_path, [recorder], data=data, rounds=rounds, topology="peer_to_peer")
    init = tiny_model(data).state_dict()
    summary = fed.run()
    ids = data.client_ids

    assert set(summary["summary"]) == {"personal", "cross"} and "pooled" not in summary
    # every node's model on every node's test set; the diagonal is the node's own ("personal") result
    matrix = summary["node_matrix"]
    assert set(matrix) == set(ids) and all(set(row) == set(ids) for row in matrix.values())
    assert all(matrix[c][c] == summary["clients"][c]["personal"] for c in ids)
    accs = [matrix[h][t]["acc"] for h in ids for t in ids]
    assert summary["summary"]["cross"]["acc"]["mean"] == pytest.approx(sum(accs) / len(accs))
    fed.module.load_state_dict({**fed.groups[0].state, **fed.transport.private[("global", ids[0])]})
    by_hand = fed.module.evaluate(data.client_test_loader(ids[1]), torch.device("cpu"))
    assert by_hand == pytest.approx(matrix[ids[0]][ids[1]], nan_ok=True)
    for cid in ids:  # round 1: every node starts from the common initial model
        assert_equal_state(recorder.starts[(0, cid)], init)
    for r in range(rounds):
        assert recorder.trained[r] == ids  # every node trains every round
        successor = random_cycle(ids, r, seed=0)
        for pred, node in successor.items():
            trained_by_pred = recorder.uploads[(r, pred)][0]
            if r + 1 < rounds:  # the next round the node starts from its predecessor's model...
                assert_equal_state(recorder.starts[(r + 1, node)], trained_by_pred)
            else:  # ...and after the last round it holds it (and is evaluated with it)
                assert_equal_state(fed.transport.private[("global", node)], trained_by_pred)
            assert not torch.equal(
                trained_by_pred["net.classifier.weight"], recorder.uploads[(r, node)][0]["net.classifier.weight"]
            )
    # the cycles differ between rounds, so the check above is not one fixed permutation
    assert len({tuple(sorted(random_cycle(ids, r, seed=0).items())) for r in range(rounds)}) > 1


# ------------------------------------------------------------------------------------------------ sampling


def test_client_sampling_trains_exactly_the_selected_clients(tmp_path):
    rounds, data = 3, tiny_data(num_clients=4)
    recorder = Recorder()
    fed = build_federation(tmp_path, [recorder], data=data, rounds=rounds, clients_per_round=2)
    summary = fed.run()
    ids = data.client_ids
    expected = {r: select_clients(ids, r, 0, 2) for r in range(rounds)}
    assert dict(recorder.trained) == expected
    assert len({tuple(s) for s in expected.values()}) > 1  # not the same pair every round

    # The last global model is the sample-weighted mean of that round's two uploads only.
    last = [recorder.uploads[(rounds - 1, c)] for c in expected[rounds - 1]]
    total = sum(n for _, n in last)
    for k in ("net.features.0.weight", "net.classifier.bias"):
        torch.testing.assert_close(fed.groups[0].state[k], sum(n / total * s[k] for s, n in last))

    rows = read_csv(Path(summary["run_dir"]) / "metrics.csv")
    assert [(int(r["round"]), r["client"]) for r in rows] == [(r + 1, c) for r in range(rounds) for c in ids]
    for row in rows:
        chosen = row["client"] in expected[int(row["round"]) - 1]
        assert row["selected"] == str(int(chosen)), row
        assert (row["train_loss"] != "") == chosen and row["failed"] == "0"
    rounds_rows = read_csv(Path(summary["run_dir"]) / "rounds.csv")
    assert [int(r["selected"]) for r in rounds_rows] == [2] * rounds


# ------------------------------------------------------------------------------------------------ failures


class FailOn(FederatedCallback):
    """Makes the named clients fail inside their local fit: by raising, or by NaN weights."""

    def __init__(self, client_ids, how="raise"):
        self.client_ids, self.how, self.client = set(client_ids), how, None

    def on_client_start(self, ctx, module):
        client_id = ctx.client_id
        self.client = client_id

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.how == "raise" and self.client in self.client_ids:
            raise RuntimeError(f"injected failure of {self.client}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.how == "nan" and self.client in self.client_ids:
            with torch.no_grad():
                pl_module.net.classifier.bias.fill_(float("nan"))


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_failing_client_is_left_out_and_the_rest_renormalised(tmp_path, how):
    rounds, data = 2, tiny_data(num_clients=3)
    recorder = Recorder()
    fed = build_federation(tmp_path, [FailOn({"site1"}, how), recorder], data=data, rounds=rounds)
    with pytest.warns(UserWarning, match="client 'site1'"):
        summary = fed.run()

    rounds_rows = read_csv(Path(summary["run_dir"]) / "rounds.csv")
    assert [int(r["round/failed_clients"]) for r in rounds_rows] == [1] * rounds
    rows = read_csv(Path(summary["run_dir"]) / "metrics.csv")
    assert [int(r["failed"]) for r in rows] == [int(r["client"] == "site1") for r in rows]
    assert all(r["train_loss"] == "" for r in rows if r["client"] == "site1")
    batches = len(data.client_train_loader("site2"))  # the client after the failed one still runs its full fit
    assert all(int(r["train_steps"]) == batches for r in rows if r["client"] == "site2")

    for r in range(rounds):
        assert (r, "site1") not in recorder.uploads
        # the next round every client starts from the global model built from the survivors
        survivors = [recorder.uploads[(r, c)] for c in ("site0", "site2")]
        total = sum(n for _, n in survivors)
        expected = {}
        for k, v in survivors[0][0].items():
            mean = sum(n / total * s[k].double() for s, n in survivors)
            expected[k] = mean.to(v.dtype) if v.is_floating_point() else mean.round().to(v.dtype)
        got = fed.groups[0].state if r == rounds - 1 else recorder.starts[(r + 1, "site0")]
        assert_same_state(got, expected, atol=1e-6)


def test_every_client_failing_ends_the_run(tmp_path):
    fed = build_federation(tmp_path, [FailOn({"site0", "site1", "site2"})], rounds=2)
    with pytest.warns(UserWarning, match="failed"), pytest.raises(RuntimeError, match="round 1: every selected client"):
        fed.run()  # round 1 as rounds.csv counts it (it said round 0)


# ------------------------------------------------------------------------------------------------ run directory


def test_run_directory_contents(tmp_path):
    rounds, data = 3, tiny_data(num_clients=3)
    fed = build_federation(tmp_path, data=data, rounds=rounds, eval_every=2)
    fed.config_text = "federation:\n  rounds: 3\n"
    summary = fed.run()
    run_dir = Path(summary["run_dir"])
    assert run_dir.parent == tmp_path
    assert (run_dir / "config.yaml").read_text() == fed.config_text
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    rows = read_csv(run_dir / "metrics.csv")
    assert len(rows) == rounds * len(data.client_ids)
    assert {"global/acc", "global/loss", "global/macro_f1", "global/balanced_acc"} <= set(rows[0])
    for row in rows:
        evaluated = row["round"] in ("2", "3")
        assert (row["global/acc"] != "") == evaluated, row
        if row["round"] == str(rounds):  # the last round's cells are the final evaluation
            final = summary["clients"][row["client"]]["global"]
            assert float(row["global/acc"]) == pytest.approx(final["acc"])
            assert float(row["global/loss"]) == pytest.approx(final["loss"])
    rounds_rows = read_csv(run_dir / "rounds.csv")
    assert [r["round"] for r in rounds_rows] == ["1", "2", "3"]
    assert [r["eval/global/acc"] != "" for r in rounds_rows] == [False, True, True]
    assert float(rounds_rows[-1]["eval/global/acc"]) == pytest.approx(summary["summary"]["global"]["acc"]["mean"])

    # A second run under the same generated name gets a directory of its own.
    again = build_federation(tmp_path, data=tiny_data(num_clients=3), rounds=1)
    other = Path(again.run()["run_dir"])
    assert other != run_dir and other.parent == tmp_path
    assert (run_dir / "summary.json").exists() and (other / "summary.json").exists()
    assert not (other / "config.yaml").exists()
    assert json.loads((run_dir / "summary.json").read_text()) == summary  # the first run is untouched


# ------------------------------------------------------------------------------------------------ reproducibility


def test_same_build_same_results(tmp_path):
    def run(path):
        fed = build_federation(path, rounds=2, clients_per_round=2, model_kwargs={"momentum": 0.9})
        summary = fed.run()
        return fed.groups[0].state, {k: summary[k] for k in ("clients", "summary", "pooled")}

    state_a, metrics_a = run(tmp_path / "a")
    state_b, metrics_b = run(tmp_path / "b")
    assert metrics_a == metrics_b
    assert_equal_state(state_a, state_b)
    assert not torch.equal(
        state_a["net.classifier.weight"], tiny_model(tiny_data()).state_dict()["net.classifier.weight"]
    )


class KeepModels(FederatedCallback):
    """Like FedER-A: models stay on their node; records the cycle handed to callbacks."""

    def __init__(self):
        self.cycles, self.trained = [], {}

    def moves_models(self):
        return False

    def on_pass_on(self, server, round_idx, successor):
        self.cycles.append(dict(successor))

    def on_client_end(self, ctx, module, update):
        client_id = ctx.client_id
        self.trained[client_id] = {k: v.clone() for k, v in update.state.items()}


def test_peer_to_peer_callbacks_see_the_cycle_and_can_keep_models_home(tmp_path):
    data = tiny_data(num_clients=3)
    keep = KeepModels()
    fed = build_federation(tmp_path, [keep], data=data, rounds=2, topology="peer_to_peer")
    fed.run()
    assert keep.cycles == [random_cycle(data.client_ids, r, seed=0) for r in range(2)]
    for cid in data.client_ids:  # each node still holds the model it trained itself
        assert_equal_state(fed.transport.private[("global", cid)], keep.trained[cid])
