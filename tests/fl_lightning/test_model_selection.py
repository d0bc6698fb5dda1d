"""Model selection on the validation split: the monitor, the best round, early stopping, the test read once."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typing_extensions import override

from callbacks import FedBN
from callbacks.base import FederatedCallback
from datamodules import DigitsFederated
from fl_lightning.config import FederationConfig
from fl_lightning.server.model_selection import (
    Monitor,
    Selection,
    available_monitors,
    default_monitor,
    monitored_value,
    parse_monitor,
)
from tests.conftest import build_federation, tiny_data

LOSS = "val/loss"  # the ruined rounds' loss explodes: the best round on it is known
TINY = {"num_clients": 3, "image_size": 8, "max_samples_per_client": 40, "batch_size": 8, "seed": 0}  # as tiny_data

EVALUATION = {
    "summary": {
        "global": {"acc": {"mean": 0.7, "std": 0.1, "worst": 0.5}, "loss": {"mean": 0.9, "std": 0.2, "worst": 1.3}},
        "personal": {"acc": {"mean": 0.8, "std": 0.05, "worst": 0.6}},
    },
    "pooled": {"acc": 0.72},
}


# ------------------------------------------------------------------------------------------------ pure bookkeeping


@pytest.mark.parametrize(
    ("text", "model", "metric", "stat", "value"),
    [
        ("val/acc_mean", "global", "acc", "mean", 0.7),
        ("val/acc", "global", "acc", "mean", 0.7),
        ("val/acc_worst", "global", "acc", "worst", 0.5),
        ("val/loss", "global", "loss", "mean", 0.9),
        ("val/loss_worst", "global", "loss", "worst", 1.3),
        ("val/personal/acc_mean", "personal", "acc", "mean", 0.8),
        ("val/personal/acc_std", "personal", "acc", "std", 0.05),
        ("val/pooled/acc", "pooled", "acc", "mean", 0.72),
    ],
)
def test_a_monitor_names_one_value_of_a_validation_evaluation(text, model, metric, stat, value):
    monitor = parse_monitor(text)
    assert (monitor.model, monitor.metric, monitor.stat) == (model, metric, stat)
    assert monitored_value(EVALUATION, monitor) == value
    spelled_out = text if text.endswith(("_mean", "_worst", "_std")) or model == "pooled" else f"{text}_mean"
    assert spelled_out in available_monitors(EVALUATION)


@pytest.mark.parametrize("text", ["eval/acc_mean", "test/acc", "acc_mean", "val/", "val/a/b/c", "val/acc mean"])
def test_a_monitor_that_is_not_a_validation_metric_is_refused(text):
    with pytest.raises(ValueError, match="federation.monitor"):
        parse_monitor(text)


def test_missing_values_are_none_and_the_default_follows_the_models():
    assert monitored_value(EVALUATION, parse_monitor("val/dice_mean")) is None
    diverged = {"summary": {"global": {}}, "clients": {"global": {"site0": {"loss": math.nan}}}}
    assert math.isnan(monitored_value(diverged, parse_monitor("val/loss")))
    assert monitored_value(diverged, parse_monitor("val/acc")) is None
    assert default_monitor("acc", has_global_model=True) == "val/acc_mean"
    assert default_monitor("dice", has_global_model=False) == "val/personal/dice_mean"


def test_lower_is_better_for_losses_distances_and_spreads():
    assert parse_monitor("val/loss").lower_is_better and parse_monitor("val/hd95_worst").lower_is_better
    assert parse_monitor("val/acc_std").lower_is_better
    assert not parse_monitor("val/acc_worst").lower_is_better


def _selection(text: str, values: list[float]) -> tuple[Selection, list[bool]]:
    selection = Selection(parse_monitor(text))
    return selection, [selection.update(r, v) for r, v in enumerate(values, start=1)]


def test_the_best_round_ties_keep_the_earlier_one_and_patience_counts_evaluations():
    selection, improved = _selection("val/acc", [0.5, 0.7, 0.7, 0.6])
    assert improved == [True, True, False, False]
    assert (selection.best_round, selection.best_value, selection.since_best) == (2, 0.7, 2)
    assert selection.stop_reason(None) is None and selection.stop_reason(3) is None
    reason = selection.stop_reason(2)
    assert "val/acc" in reason and "round 2" in reason and "patience=2" in reason
    lower, improved = _selection("val/loss", [0.9, 1.0, 0.8])
    assert improved == [True, False, True] and lower.best_round == 3
    diverged, improved = _selection("val/loss", [math.nan, 0.9, math.nan])
    assert improved == [False, True, False] and (diverged.best_round, diverged.since_best) == (2, 1)


def test_the_state_round_trips_through_a_checkpoint_entry():
    selection, _ = _selection("val/acc_worst", [0.1, 0.3, 0.2])
    selection.best_summary = {"global": {"acc": {"mean": 0.3}}}
    restored = Selection(Monitor("val/acc_worst", "global", "acc", "worst"))
    restored.load_state_dict(json.loads(json.dumps(selection.state_dict())))
    assert restored == selection


def test_patience_must_be_positive():
    with pytest.raises(ValueError, match="patience"):
        FederationConfig(patience=0)


# ------------------------------------------------------------------------------------------------ in a run


class RuinAfter(FederatedCallback):
    """From round ``after`` + 1 on, the aggregated model is replaced by large noise: its validation loss explodes, so
    the best round on ``val/loss`` is at most ``after``."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    @override
    def on_aggregate(self, server, group, previous, averaged):
        if server.round < self.after:
            return averaged
        gen = torch.Generator().manual_seed(server.round)
        return {k: torch.randn(v.shape, generator=gen) * 5 if v.is_floating_point() else v for k, v in averaged.items()}


class GuardedDigits(DigitsFederated):
    """Digits whose test loaders raise while ``opened`` is False: proof that selection never reads a test set."""

    opened = False

    @override
    def client_test_loader(self, client_id):
        if not self.opened:
            raise AssertionError(f"client {client_id!r}'s test set was read before the end of the run")
        return super().client_test_loader(client_id)


class OpenTestAtTheEnd(FederatedCallback):
    """Opens the guarded test loaders once the run's last round (the last evaluation round) is recorded."""

    def __init__(self, data: GuardedDigits) -> None:
        super().__init__()
        self.data = data

    @override
    def on_round_end(self, server, round_idx, metrics):
        if round_idx + 1 == server.config.rounds or server.choice.stop_reason():
            self.data.opened = True


def guarded(**kwargs) -> tuple[GuardedDigits, OpenTestAtTheEnd]:
    data = GuardedDigits(**{**TINY, "val_fraction": 0.25, **kwargs})
    return data, OpenTestAtTheEnd(data)


def _run(tmp_path, name, callbacks=(), data=None, **config):
    data = data or tiny_data(val_fraction=0.25)
    fed = build_federation(tmp_path, callbacks=list(callbacks), data=data, run_name=name, **config)
    return fed.run(), fed


def test_select_best_needs_a_validation_split(tmp_path):
    with pytest.raises(ValueError, match="val_fraction"):
        _run(tmp_path, "no-val", data=tiny_data(), select="best")
    with pytest.raises(ValueError, match="val_fraction"):
        _run(tmp_path, "no-val-patience", data=tiny_data(), patience=2)


def test_best_reports_the_chosen_rounds_test_metrics_equal_to_a_run_stopped_there(tmp_path):
    data, opener = guarded()
    best, fed = _run(tmp_path, "best", [RuinAfter(2), opener], data=data, rounds=4, select="best", monitor=LOSS)
    chosen = best["selection"]["round"]
    assert chosen <= 2 < best["rounds"] == 4
    assert best["selection"]["select"] == "best" and best["selection"]["monitor"] == LOSS
    assert best["selection"]["value"] == min(v for _, v in fed.choice.selection.history)
    assert best["last_round"]["round"] == 4
    stopped, _ = _run(tmp_path, "stopped", [RuinAfter(2)], rounds=chosen)
    assert best["summary"] == stopped["summary"] and best["clients"] == stopped["clients"]
    assert best["summary"] != best["last_round"]["summary"]  # the ruined last round is reported beside it
    rows = (tmp_path / "best" / "rounds.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert "select/value" in header and "val/global/acc" in header
    assert not any(h.startswith("eval/") for h in header)  # the rounds scored validation sets only


def test_last_with_a_validation_split_reads_the_test_set_once_at_the_end(tmp_path):
    data, opener = guarded()
    last, _ = _run(tmp_path, "last", [opener], data=data, rounds=3)
    assert last["selection"]["round"] == 3 and "last_round" not in last
    plain, _ = _run(tmp_path, "plain", rounds=3)
    assert last["summary"] == plain["summary"]


def test_early_stopping_ends_the_run_after_patience_rounds_without_improvement(tmp_path):
    data, opener = guarded()
    out, fed = _run(tmp_path, "early", [RuinAfter(2), opener], data=data, rounds=8, patience=2,
                    select="best", monitor=LOSS)  # fmt: skip
    best = out["selection"]["round"]
    assert out["rounds"] == best + 2 < 8
    assert "early stopping" in out["stopped"]
    assert fed.choice.selection.since_best == 2


def test_private_states_of_the_chosen_round_are_evaluated(tmp_path):
    """FedBN keeps the norm layers on the clients: the chosen round's personal models are the kept copies."""
    best, _ = _run(tmp_path, "fedbn-best", [FedBN(), RuinAfter(2)], rounds=4, select="best", monitor=LOSS,
                   model_kwargs={"norm": "batch"})  # fmt: skip
    chosen = best["selection"]["round"]
    stopped, _ = _run(tmp_path, "fedbn-stopped", [FedBN(), RuinAfter(2)], rounds=chosen,
                      model_kwargs={"norm": "batch"})  # fmt: skip
    assert best["summary"]["personal"] == stopped["summary"]["personal"]
    assert best["summary"]["personal"] != best["summary"]["global"]  # private norm layers do differ


def test_a_resumed_run_selects_and_reports_as_the_uninterrupted_one(tmp_path):
    whole, _ = _run(tmp_path, "whole", [FedBN(), RuinAfter(2)], rounds=4, select="best", monitor=LOSS,
                    model_kwargs={"norm": "batch"})  # fmt: skip
    _run(
        tmp_path, "part", [FedBN(), RuinAfter(2)], rounds=3, select="best", monitor=LOSS, model_kwargs={"norm": "batch"}
    )
    resumed, _ = _run(tmp_path, "part", [FedBN(), RuinAfter(2)], rounds=4, select="best", monitor=LOSS, resume="last",
                      model_kwargs={"norm": "batch"})  # fmt: skip
    assert resumed["selection"] == whole["selection"]
    assert resumed["summary"] == whole["summary"] and resumed["last_round"] == whole["last_round"]


def test_the_loggers_get_the_test_metrics_once_at_the_end(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path / "csv", name="run")
    out, _ = _run(tmp_path, "logged", [RuinAfter(2)], rounds=3, select="best", monitor=LOSS,
                  trainer_kwargs={"logger": logger})  # fmt: skip
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert "test/global/acc" in header and "test_last/global/acc" in header and "test/round" in header
    assert "val/global/acc" in header and not any(h.startswith("eval/") for h in header)
    final = [dict(zip(header, r.split(","), strict=True)) for r in rows[1:] if r.split(",")[header.index("test/round")]]
    assert len(final) == 1 and float(final[0]["test/round"]) == out["selection"]["round"]
    assert float(final[0]["test/global/acc"]) == pytest.approx(out["summary"]["global"]["acc"]["mean"])
