"""Refusals before any trial runs: keys and ranges judged by the config's own parser, objectives the runs never log."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_lightning.tools.sweep.space import SpaceError, parse_space
from fl_lightning.tools.sweep.validate import (
    Probe,
    check_objective,
    check_space,
    objective_direction,
    parse_config,
    parse_reason,
    probe_config,
)
from tests.sweep.tiny import FEDPROX, SPACE, TINY

BASE = ["--config", FEDPROX, *TINY]


@pytest.fixture(scope="module")
def config():
    return parse_config(BASE)


def check(config, raw):
    check_space(parse_space(raw, Path("s.yaml")), BASE, config)


def test_a_valid_space_passes(config):
    check(config, SPACE)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"model.init_args.lrr": {"type": "uniform", "low": 0.1, "high": 1}}, "model.init_args.lrr: not a key"),
        ({"trainer.callbacks[Scaffold].c": {"type": "uniform", "low": 0, "high": 1}}, "no callback 'Scaffold'"),
        ({"model.init_args.width": {"type": "uniform", "low": 4, "high": 16}},
         r"model.init_args.width: a uniform range samples floats but .* is an integer setting .* use \{type: int, "
         r"low: 4, high: 16\}"),
        ({"model.init_args.optimizer": {"type": "categorical", "choices": ["sgd", "nesterov"]}},
         "model.init_args.optimizer: the config's parser refuses the value 'nesterov': expects typing.Literal\\["),
        ({"trainer.callbacks[FedProx].mu": {"type": "categorical", "choices": [0.1, "big"]}},
         r"trainer.callbacks\[FedProx\].mu: the config's parser refuses the value 'big': expects float"),
        ({"federation.rounds": 2.5, "model.init_args.lr": {"type": "uniform", "low": 0.01, "high": 0.1}},
         "federation.rounds: the config's parser refuses the value 2.5: expects int"),
    ],
)  # fmt: skip
def test_a_key_or_value_the_config_does_not_take_is_refused_naming_the_key(config, raw, message):
    with pytest.raises(SpaceError, match=message):
        check(config, raw)


def test_the_parsers_reason_is_the_line_that_matters():
    dump = (
        'Parser key "model":\n  Errors:\n    - Problem with given class_path:\n        Parser key "width":\n'
        "          Expected a <class 'int'>. Got value: 4.5\n    - Expected a <class 'NoneType'>\n"
    )
    assert parse_reason(dump) == "expects int, got 4.5"
    assert parse_reason("    Option 'lrr' is not accepted\n") == "Option 'lrr' is not accepted"
    assert parse_reason("something else\nlast line\n") == "last line"


PROBE = Probe(metrics=("acc", "loss"), has_validation=True, has_global_model=True, primary_metric="acc")


@pytest.mark.parametrize(
    ("objective", "probe", "message"),
    [
        ("eval/acc_mean", PROBE, "--objective eval/acc_mean: expected val/"),
        ("test/acc", PROBE, "--objective test/acc: expected val/"),
        ("val/acc_mean", Probe(("acc",), False, True, "acc"), "no validation split.*val_fraction"),
        ("val/dice_mean", PROBE, "produces no metric 'dice'; it produces acc, loss"),
        ("val/cluster/acc_mean", PROBE, "no model 'cluster'"),
        ("val/acc_mean", Probe(("acc",), True, False, "acc"), "no model 'global'"),
        ("val/pooled/acc", Probe(("acc",), True, False, "acc"), "no model 'pooled'"),
    ],
)
def test_an_objective_the_runs_never_log_is_refused(objective, probe, message):
    with pytest.raises(ValueError, match=message):
        check_objective(objective, probe)


def test_objectives_the_runs_log_pass_with_their_direction():
    assert objective_direction(check_objective("val/acc_worst", PROBE), None) == "maximize"
    assert objective_direction(check_objective("val/loss", PROBE), None) == "minimize"
    assert objective_direction(check_objective("val/personal/acc_std", PROBE), None) == "minimize"
    assert objective_direction(check_objective("val/pooled/acc", PROBE), "minimize") == "minimize"


def test_the_probe_reads_the_metric_names_from_the_configured_module(config):
    probe = probe_config([*BASE, "--data.init_args.val_fraction=0.25"], config)
    assert {"acc", "loss", "balanced_acc"} <= set(probe.metrics)
    assert probe.has_validation and probe.has_global_model and probe.primary_metric == "acc"
    assert not probe_config(BASE, config).has_validation
