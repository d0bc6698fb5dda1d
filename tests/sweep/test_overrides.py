"""A trial's values as train.py arguments: plain keys, callbacks by class name or position, values read back as set."""

from __future__ import annotations

import json

import pytest

from fl_lightning.tools.sweep.overrides import KeyNotFound, format_value, lookup, trial_overrides

CALLBACKS = [
    {"class_path": "callbacks.AmplitudeNormalization", "init_args": {"v": 0.1, "band": 0.25}},
    {"class_path": "callbacks.WeightPerturbation", "init_args": {"alpha": 0.01}},
    {"class_path": "callbacks.FedProx", "init_args": {"mu": 0.01}},
    {"class_path": "callbacks.fedprox.FedProx", "init_args": {"mu": 0.02}},
]
CONFIG = {"model": {"init_args": {"lr": 0.05, "width": 32}}, "trainer": {"callbacks": CALLBACKS}}


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.01, "0.01"), (1e-05, "1.0e-05"), (2.5e-07, "2.5e-07"), (3, "3"), (True, "true"), (None, "null"),
     ("adam", "adam")],
)  # fmt: skip
def test_values_are_written_as_yaml_reads_them_back(value, text):
    assert format_value(value) == text


def test_plain_keys_become_one_override_each_and_callbacks_one_list():
    args = trial_overrides(
        {"model.init_args.lr": 0.1, "trainer.callbacks[WeightPerturbation].alpha": 0.05,
         "trainer.callbacks[0].init_args.band": 1.0, "trainer.callbacks[FedProx#2].mu": 0.5},
        CALLBACKS,
    )  # fmt: skip
    assert args[0] == "--model.init_args.lr=0.1"
    assert args[1].startswith("--trainer.callbacks=")
    listed = json.loads(args[1].split("=", 1)[1])
    assert [c["init_args"] for c in listed] == [{"v": 0.1, "band": 1.0}, {"alpha": 0.05}, {"mu": 0.01}, {"mu": 0.5}]
    assert CALLBACKS[1]["init_args"] == {"alpha": 0.01}  # the resolved list itself is left as it was


def test_a_callback_without_init_args_gets_them():
    args = trial_overrides({"trainer.callbacks[FedBN].x": 1}, {"class_path": "callbacks.FedBN"})
    assert json.loads(args[0].split("=", 1)[1]) == [{"class_path": "callbacks.FedBN", "init_args": {"x": 1}}]


def test_lookup_finds_plain_and_callback_keys():
    assert lookup(CONFIG, "model.init_args.lr") == 0.05
    assert lookup(CONFIG, "trainer.callbacks[FedProx].mu") == 0.01
    assert lookup(CONFIG, "trainer.callbacks[FedProx#2].init_args.mu") == 0.02
    assert lookup(CONFIG, "trainer.callbacks[1].alpha") == 0.01


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("model.init_args.lrr", "model.init_args.lrr: not a key of the parsed config; model.init_args has: lr, width"),
        ("modle.lr", "modle.lr: not a key of the parsed config; the config has: model, trainer"),
        ("model.init_args.lr.x", r"\(model.init_args.lr is not a section\)"),
        ("trainer.callbacks[Scaffold].c", r"no callback 'Scaffold'; its callbacks: \[0\] AmplitudeNormalization"),
        ("trainer.callbacks[FedProx#3].mu", "no callback 'FedProx#3'"),
        ("trainer.callbacks[7].mu", "no callback '7'"),
        ("trainer.callbacks[FedProx].nu", r"trainer.callbacks\[FedProx\] has: mu"),
        ("trainer.callbacks[FedProx]", "trainer.callbacks\\[<Class>\\].<argument>"),
    ],
)
def test_an_unknown_key_is_named_with_what_is_there(key, message):
    with pytest.raises(KeyNotFound, match=message):
        lookup(CONFIG, key)
