"""What the loggers get per round: per-client keys for few clients, one table for many (pure functions)."""

from __future__ import annotations

from fl_lightning.outputs import records

TRAINED = {"a": {"train_loss": 0.5, "train_steps": 3, "train_samples": 24}, "c": {"train_loss": 0.7, "train_steps": 2}}
EVALUATION = {
    "clients": {"global": {"a": {"acc": 0.9}, "b": {"acc": 0.8}}, "personal": {"b": {"acc": 0.85}}},
    "summary": {"global": {"acc": {"mean": 0.85, "std": 0.05, "worst": 0.8, "worst_client": "b"}}},
    "pooled": {"acc": 0.86},
}
ROW = {"round": 2, "time/train": 1.5, "selected": 2}


def test_few_clients_get_per_client_keys():
    out = records.logged_metrics(ROW, TRAINED, EVALUATION)
    assert out["client/a/train/loss"] == 0.5 and out["client/b/eval/personal/acc"] == 0.85
    assert out["eval/global/acc"] == 0.85 and out["eval/pooled/acc"] == 0.86 and out["time/train"] == 1.5


def test_many_clients_get_round_metrics_only_and_one_table():
    out = records.logged_metrics(ROW, TRAINED, EVALUATION, per_client=False)
    assert not any(k.startswith("client/") for k in out)
    assert out == {k: v for k, v in records.logged_metrics(ROW, TRAINED, EVALUATION).items() if "client/" not in k}
    columns, rows = records.client_table(TRAINED, EVALUATION)
    assert columns == [
        "client", "train/loss", "train/steps", "train/samples", "eval/global/acc", "eval/personal/acc"
    ]  # fmt: skip
    assert rows == [
        ["a", 0.5, 3, 24, 0.9, None],
        ["c", 0.7, 2, None, None, None],
        ["b", None, None, None, 0.8, 0.85],
    ]


def test_the_threshold():
    assert records.per_client_keys(records.PER_CLIENT_KEYS_MAX)
    assert not records.per_client_keys(records.PER_CLIENT_KEYS_MAX + 1)
