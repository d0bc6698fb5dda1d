"""Cross-site evaluation (cross_site.csv) and federation.mode: evaluate, against scoring the models by hand."""

import pytest
import torch

from fl_lightning import FederationConfig
from fl_lightning.server.cross_site import read_cross_site
from tests.conftest import build_federation, reference_sgd, tiny_data, tiny_model


def _scores(state, data):
    """Every client's test metrics of one model state, computed directly with the module."""
    module = tiny_model(data)
    module.load_state_dict(state)
    return {c: module.evaluate(data.client_test_loader(c), torch.device("cpu")) for c in data.client_ids}


def _close(got, expected):
    for name in ("acc", "balanced_acc", "loss"):
        assert got[name] == pytest.approx(expected[name], abs=1e-5), name


def test_local_cross_site_equals_each_local_model_scored_by_hand(tmp_path):
    fed = build_federation(tmp_path, rounds=2, mode="local", plots=True)
    fed.run()
    matrix = read_cross_site(fed.run_dir.path / "cross_site.csv")
    data = tiny_data()
    ids = list(data.client_ids)
    assert set(matrix) == set(ids) and all(set(row) == {*ids, "pooled"} for row in matrix.values())
    template = tiny_model(data)
    for holder in ids:
        # local mode: the client trains alone, its optimiser kept (no momentum: the same as a fresh one)
        batches = [list(data.client_train_loader(holder)) for _ in range(2)]
        net_state = reference_sgd(template.net, batches, lr=0.1)
        state = {**template.state_dict(), **{f"net.{k}": v for k, v in net_state.items()}}
        by_hand = _scores(state, data)
        for target in ids:
            _close(matrix[holder][target], by_hand[target])
    assert (fed.run_dir.path / "cross_site.png").stat().st_size > 0
    # the diagonal is what the run's own (personal) evaluation reports
    personal = fed.last_evaluation["clients"]["personal"]
    for c in ids:
        assert matrix[c][c]["acc"] == pytest.approx(personal[c]["acc"], abs=1e-9)


def test_pooled_column_is_the_model_on_all_test_sets_together(tmp_path):
    fed = build_federation(tmp_path, rounds=1, mode="local")
    fed.run()
    assert not (fed.run_dir.path / "cross_site.png").exists()  # federation.plots=false: the table, no figure
    matrix = read_cross_site(fed.run_dir.path / "cross_site.csv")
    data = tiny_data()
    n = {c: data.num_test_samples(c) for c in data.client_ids}
    for holder, row in matrix.items():  # pooled accuracy = the test-size-weighted mean of the per-site ones
        weighted = sum(row[c]["acc"] * n[c] for c in n) / sum(n.values())
        assert row["pooled"]["acc"] == pytest.approx(weighted, abs=1e-9), holder


def test_no_cross_site_by_default_in_a_federated_run_and_on_request(tmp_path):
    plain = build_federation(tmp_path / "a", rounds=1)
    plain.run()
    assert not (plain.run_dir.path / "cross_site.csv").exists()
    asked = build_federation(tmp_path / "b", rounds=1, cross_site=True)
    asked.run()
    matrix = read_cross_site(asked.run_dir.path / "cross_site.csv")
    first = next(iter(matrix.values()))
    assert all(row == first for row in matrix.values())  # FedAvg: every client's own model is the global one


def test_evaluate_mode_scores_the_given_weights_without_training(tmp_path):
    trained = build_federation(tmp_path / "train", rounds=2)
    trained.run()
    state = trained.groups[0].state
    path = tmp_path / "weights.pt"
    torch.save(state, path)
    fed = build_federation(tmp_path / "eval", mode="evaluate", weights=str(path))
    summary = fed.run()
    by_hand = _scores(state, tiny_data())
    for c, metrics in fed.last_evaluation["clients"]["global"].items():
        _close(metrics, by_hand[c])
    assert summary["weights"] == str(path)
    for k, v in state.items():  # nothing trained
        assert torch.equal(fed.groups[0].state[k], v), k
    # a round checkpoint gives the same model
    ckpt = sorted((trained.run_dir.path / "checkpoints").glob("round-*.ckpt"))[-1]
    again = build_federation(tmp_path / "eval2", mode="evaluate", weights=str(ckpt))
    again.run()
    assert again.last_evaluation["clients"]["global"] == fed.last_evaluation["clients"]["global"]


def test_evaluate_mode_refuses_weights_of_another_model(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"linear.weight": torch.zeros(2, 3)}, path)
    fed = build_federation(tmp_path, mode="evaluate", weights=str(path))
    with pytest.raises(ValueError, match=r"federation.weights=.*other.pt does not fit the configured model"):
        fed.run()


def test_evaluate_mode_and_weights_go_together():
    with pytest.raises(ValueError, match="federation.mode=evaluate and federation.weights go together"):
        FederationConfig(mode="evaluate")
    with pytest.raises(ValueError, match="go together"):
        FederationConfig(weights="w.pt")
