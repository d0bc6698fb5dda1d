"""Degenerate training is reported: single-class predictions, chance balanced accuracy, loss growth, no test set."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from fl_lightning.clients.metrics import classification_metrics
from fl_lightning.outputs import collapse
from fl_lightning.outputs.collapse import (
    DegenerateTrainingWarning,
    balanced_acc_at_chance,
    clients_without_test,
    detect_collapse,
    loss_growth,
    mean_train_loss_by_round,
    single_class_predictions,
)
from fl_lightning.outputs.records import summary_table
from tests.conftest import build_federation, tiny_data, tiny_model

HEALTHY = {"acc": 0.89, "balanced_acc": 0.81, "auroc": 0.93, "predicted_classes": 2.0}
# The HarmoFL collapse of the issue: the majority-class rate as accuracy, balanced accuracy 0.5.
MAJORITY = {"acc": 0.85, "balanced_acc": 0.5, "auroc": 0.6, "predicted_classes": 1.0}


def rows(losses_by_round: dict[int, list[float | None]]) -> list[dict]:
    """metrics.csv rows: one per client and round; None = not selected (no train_loss)."""
    out = []
    for r, losses in losses_by_round.items():
        for i, loss in enumerate(losses):
            row = {"round": r, "client": f"site{i}", "selected": int(loss is not None)}
            if loss is not None:
                row["train_loss"] = loss
            out.append(row)
    return out


# ------------------------------------------------------------------------------------------ the checks


def test_predicted_classes_counts_distinct_predictions():
    target = torch.tensor([0, 0, 0, 1])
    majority = classification_metrics(torch.tensor([[2.0, 0.0]] * 4), target, 2)
    assert majority["predicted_classes"] == 1 and majority["acc"] == 0.75 and majority["balanced_acc"] == 0.5
    assert single_class_predictions(majority) is True


def test_single_class_predictions():
    assert single_class_predictions(MAJORITY) is True
    assert single_class_predictions(HEALTHY) is False
    # a test set of one class (AUROC undefined): predicting that class is right, not a collapse
    assert single_class_predictions({**MAJORITY, "auroc": math.nan}) is False
    assert single_class_predictions({"dice": 0.7}) is None  # segmentation: not decidable


def test_balanced_accuracy_at_chance():
    assert balanced_acc_at_chance(MAJORITY, 2) is True
    assert balanced_acc_at_chance({"balanced_acc": 0.515}, 2) is True  # within the margin
    assert balanced_acc_at_chance({"balanced_acc": 0.66}, 2) is False  # HarmoFL at α = 0.01 trained
    assert balanced_acc_at_chance({"balanced_acc": 0.11}, 10) is True
    assert balanced_acc_at_chance({"balanced_acc": 0.4}, 10) is False
    assert balanced_acc_at_chance(MAJORITY, None) is None
    assert balanced_acc_at_chance({"balanced_acc": math.nan}, 2) is None


def test_mean_train_loss_by_round_skips_unselected_and_non_finite():
    losses = mean_train_loss_by_round(rows({1: [1.0, 3.0, None], 2: [math.inf, 0.5, "0.7"], 3: [None, None, None]}))
    assert losses == pytest.approx({1: 2.0, 2: 0.6})


def test_loss_growth_by_orders_of_magnitude():
    # SCAFFOLD on the binary Dirichlet(0.1) task: ~1 in round 1, 122 by round 11, 2.4e7 by round 20
    diverged = {1: 1.09, 5: 0.6, 11: 122.0, 20: 2.4e7}
    assert loss_growth(diverged) == (11, 122.0, 1.09)
    assert loss_growth({1: 2.3, 2: 1.2, 3: 0.4, 4: 0.9}) is None  # noisy but no divergence
    assert loss_growth({1: 1.0, 2: 50.0}) is None and loss_growth({1: 1.0, 2: 50.0}, factor=10) == (2, 50.0, 1.0)
    assert loss_growth({}) is None


def test_detect_collapse_gives_flags_and_messages():
    found = detect_collapse({"pooled": MAJORITY}, rows({1: [1.0, 1.2], 2: [300.0, 1e4]}), num_classes=2)
    assert found.detected and found.single_class_predictions and found.balanced_acc_at_chance
    assert found.train_loss_growth is True
    assert len(found.messages) == 2  # chance is implied by a single predicted class: not said twice
    assert "single class" in found.messages[0] and "0.850" in found.messages[0]
    assert "round 2" in found.messages[1] and "diverged" in found.messages[1]
    at_chance = detect_collapse({"pooled": {**HEALTHY, "balanced_acc": 0.505}}, num_classes=2)
    assert at_chance.balanced_acc_at_chance and not at_chance.single_class_predictions
    assert len(at_chance.messages) == 1 and "1/2 = 0.500" in at_chance.messages[0]
    healthy = detect_collapse({"pooled": HEALTHY}, rows({1: [2.3], 2: [0.4]}), num_classes=2)
    assert not healthy.detected and healthy.messages == ()
    assert healthy.as_dict() == {
        "detected": False,
        "single_class_predictions": False,
        "balanced_acc_at_chance": False,
        "train_loss_growth": False,
        "single_class_clients": None,
        "zero_dice_clients": None,
        "foreground_everywhere_clients": None,
        "degenerate_rounds": None,
        "messages": [],
    }


ONE_CLASS_SITE = {"predicted_classes": 1.0, "auroc": 0.5}
TRAINED_SITE = {"predicted_classes": 4.0, "auroc": 0.9}
ONE_CLASS_HELD = {"predicted_classes": 1.0, "auroc": math.nan}  # the test set holds one class: right, not collapse


def test_a_single_class_on_some_sites_is_flagged_even_when_the_pooled_set_is_fine():
    evaluation = {"pooled": HEALTHY, "clients": {"global": {"a": TRAINED_SITE, "b": ONE_CLASS_SITE,
                  "c": ONE_CLASS_SITE, "d": ONE_CLASS_HELD}}}  # fmt: skip
    found = detect_collapse(evaluation, num_classes=2)
    assert found.detected and not found.single_class_predictions
    assert found.single_class_clients == ("b", "c")
    assert any("2 of 4 client(s)" in m and "b, c" in m for m in found.messages)
    healthy = detect_collapse({"pooled": HEALTHY, "clients": {"global": {"a": TRAINED_SITE, "d": ONE_CLASS_HELD}}})
    assert healthy.single_class_clients == () and not healthy.detected


def test_a_segmentation_model_with_no_foreground_is_flagged():
    evaluation = {"clients": {"global": {"a": {"dice": 0.0, "miou": 0.4}, "b": {"dice": 0.3}}}}
    found = detect_collapse(evaluation)
    assert found.zero_dice_clients == ("a",) and found.detected
    assert any("foreground Dice is 0 on 1 of 2" in m for m in found.messages)
    assert detect_collapse({"clients": {"global": {"a": {"dice": 0.2}}}}).zero_dice_clients == ()


def eval_rows(per_round: dict[int, dict[str, dict]]) -> list[dict]:
    """metrics.csv rows with global metrics, as strings (as read back from the CSV on resume)."""
    return [{"round": r, "client": c, **{f"global/{k}": str(v) for k, v in m.items()}}
            for r, clients in per_round.items() for c, m in clients.items()]  # fmt: skip


def test_rounds_stuck_at_one_class_are_recorded_even_when_the_run_recovers():
    stuck = {"a": ONE_CLASS_SITE, "b": ONE_CLASS_SITE}
    well = {"a": TRAINED_SITE, "b": TRAINED_SITE}
    history = eval_rows({1: stuck, 2: stuck, 3: stuck, 4: {"a": TRAINED_SITE, "b": ONE_CLASS_SITE}, 6: well})
    assert collapse.degenerate_rounds(history) == [1, 2, 3]
    found = detect_collapse({"pooled": HEALTHY, "clients": {"global": well}}, history, num_classes=2)
    assert not found.detected and found.degenerate_rounds == (1, 2, 3)
    assert any("in round(s) 1-3 before it recovered" in m for m in found.messages)
    segmentation = eval_rows({1: {"a": {"dice": 0.0}}, 2: {"a": {"dice": 0.5}}})
    assert collapse.degenerate_rounds(segmentation) == [1]
    assert collapse.degenerate_rounds([{"round": 1, "client": "a", "train_loss": 1.0}]) is None


def test_without_pooled_evaluation_the_checks_are_not_made():
    found = detect_collapse({"summary": {"personal": {}}})
    assert found.as_dict()["single_class_predictions"] is None
    assert found.balanced_acc_at_chance is None and found.train_loss_growth is None and not found.detected


# ------------------------------------------------------------------------------------------ summary.json


def test_summary_flags_collapse_and_names_clients_without_test():
    evaluation = {
        "clients": {"global": {"site0": MAJORITY}},
        "summary": {"global": {}},
        "pooled": MAJORITY,
    }
    summary = summary_table(
        evaluation, {"site0": 20, "site1": 0}, 20, {"mode": "federated"}, rows({1: [1.0, 1.0]}), num_classes=2
    )
    assert summary["clients_without_test"] == ["site1"]
    assert summary["collapse"]["detected"] is True
    assert summary["collapse"]["single_class_predictions"] and summary["collapse"]["balanced_acc_at_chance"]
    assert summary["collapse"]["train_loss_growth"] is False


def test_a_collapsed_federation_says_so_in_its_summary(tmp_path):
    data = tiny_data()
    model = tiny_model(data, lr=1e-9)  # (almost) no learning: the model below stays collapsed
    with torch.no_grad():  # every image scores class 3 highest
        model.net.classifier.weight.zero_()
        model.net.classifier.bias.copy_(torch.nn.functional.one_hot(torch.tensor(3), 10).float() * 10)
    summary = build_federation(tmp_path, data=data, model=model, rounds=1).run()
    assert summary["pooled"]["predicted_classes"] == 1
    assert summary["collapse"]["detected"] is True and summary["collapse"]["single_class_predictions"] is True
    assert summary["clients_without_test"] == []


# ------------------------------------------------------------------------------------------ clients without test


class FakeData:
    def __init__(self, test_sizes: dict[str, int]) -> None:
        self.sizes = test_sizes
        self.client_ids = list(test_sizes)

    def num_test_samples(self, client_id: str) -> int:
        return self.sizes[client_id]


def test_clients_without_test_are_named_and_warned_about():
    data = FakeData({"site0": 12, "site1": 0, "site2": 3, "site3": 0})
    assert clients_without_test(data) == ["site1", "site3"]
    with pytest.warns(DegenerateTrainingWarning, match=r"2 client\(s\) have no test images.*site1, site3"):
        assert collapse.warn_clients_without_test(data) == ["site1", "site3"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert collapse.warn_clients_without_test(FakeData({"site0": 1})) == []


def test_clients_without_test_on_a_real_datamodule():
    assert clients_without_test(tiny_data()) == []


def test_warn_collapse_warns_each_message():
    with pytest.warns(DegenerateTrainingWarning) as record:
        messages = collapse.warn_collapse({"collapse": {"messages": ["a", "b"]}})
    assert messages == ["a", "b"] and [str(w.message) for w in record] == ["a", "b"]
    assert collapse.warn_collapse({}) == []


def test_each_client_is_judged_by_the_model_it_is_evaluated_with():
    """Failed before: a healthy FedBN run was flagged because only the global model's per-client numbers were read."""
    fedbn = {"pooled": HEALTHY, "clients": {"global": {"a": TRAINED_SITE, "b": ONE_CLASS_SITE},
             "personal": {"a": TRAINED_SITE, "b": TRAINED_SITE}}}  # fmt: skip
    found = detect_collapse(fedbn, num_classes=2)
    assert found.single_class_clients == () and not found.detected
    broken = {"pooled": HEALTHY, "clients": {"global": {"a": TRAINED_SITE, "b": TRAINED_SITE},
              "personal": {"a": TRAINED_SITE, "b": ONE_CLASS_SITE}}}  # fmt: skip
    found = detect_collapse(broken, num_classes=2)
    assert found.single_class_clients == ("b",) and found.detected
    assert any(m.startswith("the personal model (each client's own") and "1 of 2" in m for m in found.messages)
    nan = {**ONE_CLASS_SITE, "auroc_extra": float("nan")}  # a decoded copy holds another NaN object
    same = {
        "pooled": HEALTHY,
        "clients": {"global": {"b": nan}, "personal": {"b": {**nan, "auroc_extra": float("nan")}}},
    }
    assert any(m.startswith("the global model predicts") for m in detect_collapse(same, num_classes=2).messages)


def test_a_segmentation_model_that_paints_foreground_everywhere_is_flagged():
    """Failed before: only background everywhere (Dice 0) was flagged; ~98 % foreground at Dice 0.045 was not."""
    evaluation = {"clients": {"global": {"a": {"dice": 0.045, "predicted_foreground": 0.98},
                                         "b": {"dice": 0.7, "predicted_foreground": 0.08}}}}  # fmt: skip
    found = detect_collapse(evaluation)
    assert found.foreground_everywhere_clients == ("a",) and found.detected
    assert any("foreground everywhere" in m and "1 of 2" in m for m in found.messages)
    mostly_foreground = {"clients": {"global": {"a": {"dice": 0.97, "predicted_foreground": 0.98}}}}
    assert detect_collapse(mostly_foreground).foreground_everywhere_clients == ()  # right when the masks are so
    assert detect_collapse({"clients": {"global": {"a": {"dice": 0.2}}}}).foreground_everywhere_clients is None
