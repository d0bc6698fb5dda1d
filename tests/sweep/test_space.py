"""The space file: every distribution, FLamby's grid, fixed values, and each malformed entry refused naming its key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fl_lightning.tools.sweep.space import Param, SpaceError, flamby_grid, load_space, parse_param, parse_space

HERE = Path("space.yaml")


def test_every_kind_parses_with_its_fields():
    space = parse_space(
        {
            "data.init_args.val_fraction": 0.2,
            "model.init_args.lr": {"type": "log_uniform", "low": 1e-4, "high": 0.1},
            "model.init_args.momentum": {"type": "uniform", "low": 0, "high": 0.9},
            "model.init_args.width": {"type": "int", "low": 4, "high": 16, "log": True},
            "model.init_args.optimizer": {"type": "categorical", "choices": ["sgd", "adam"]},
            "trainer.callbacks[FedProx].mu": {"type": "flamby_grid", "low_k": -4, "high_k": -2},
        },
        HERE,
    )
    assert space.fixed == {"data.init_args.val_fraction": 0.2}
    kinds = {p.key: p.kind for p in space.params}
    assert list(kinds.values()) == ["log_uniform", "uniform", "int", "categorical", "flamby_grid"]
    assert space.params[2] == Param("model.init_args.width", "int", 4, 16, log=True)
    assert space.params[4].choices == (0.01, 0.0316227766017, 0.1)
    assert space.keys[-1] == "data.init_args.val_fraction"


def test_flamby_grid_is_ten_to_the_half_k():
    assert flamby_grid(-4, 0) == (0.01, 0.0316227766017, 0.1, 0.316227766017, 1.0)
    for k, value in zip(range(-7, 3), flamby_grid(-7, 2)):
        assert math.isclose(value, 10 ** (k / 2), rel_tol=1e-11)
    assert flamby_grid(-2, -2) == (0.1,)  # exactly 0.1, not 10 ** -1.0's neighbour
    with pytest.raises(ValueError, match="low_k"):
        flamby_grid(-1, -3)
    with pytest.raises(TypeError):
        flamby_grid(-1.5, 0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "normal", "low": 0, "high": 1}, "type 'normal' is not one of"),
        ({"low": 0, "high": 1}, "type None is not one of"),
        ({"type": "uniform", "low": 0}, "uniform needs high"),
        ({"type": "uniform", "low": 0, "high": 1, "step": 0.1}, "not step"),
        ({"type": "uniform", "low": 1, "high": 0}, r"low \(1\) > high \(0\): swap them"),
        ({"type": "uniform", "low": "a", "high": 1}, "low must be a finite number"),
        ({"type": "uniform", "low": 0, "high": float("inf")}, "high must be a finite number"),
        ({"type": "log_uniform", "low": 0, "high": 1}, "needs low > 0"),
        ({"type": "log_uniform", "low": -1, "high": 1}, "needs low > 0"),
        ({"type": "int", "low": 0.5, "high": 4}, "integer bounds, got low=0.5"),
        ({"type": "int", "low": True, "high": 4}, "integer bounds"),
        ({"type": "int", "low": 0, "high": 4, "log": True}, "log int range needs low >= 1"),
        ({"type": "int", "low": 1, "high": 4, "log": "yes"}, "log is true or false"),
        ({"type": "int", "low": 5, "high": 4}, "swap them"),
        ({"type": "categorical", "choices": []}, "non-empty list"),
        ({"type": "categorical", "choices": "sgd"}, "non-empty list"),
        ({"type": "categorical", "choices": [[1, 2]]}, "a choice is a number"),
        ({"type": "categorical", "choices": [0.1, 0.1]}, "listed twice"),
        ({"type": "flamby_grid", "low_k": -2.5, "high_k": 0}, "integer k"),
        ({"type": "flamby_grid", "low_k": 0, "high_k": -2}, r"low_k \(0\) > high_k \(-2\)"),
    ],
)
def test_a_malformed_entry_is_refused_naming_its_key(spec, message):
    with pytest.raises(SpaceError, match=message) as err:
        parse_param("model.init_args.lr", spec, HERE)
    assert "model.init_args.lr" in str(err.value) and "space.yaml" in str(err.value)


def test_the_same_value_of_two_types_is_two_choices():
    assert parse_param("k", {"type": "categorical", "choices": [1, True, "1"]}).choices == (1, True, "1")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([1, 2], "expected a mapping"),
        ({}, "expected a mapping"),
        ({"--model.lr": 0.1}, "not a config key"),
        ({"model.init_args.lr": [0.1, 0.2]}, "expected a distribution"),
        ({"data.init_args.val_fraction": 0.2}, "no key is searched"),
    ],
)
def test_a_malformed_file_is_refused(raw, message):
    with pytest.raises(SpaceError, match=message):
        parse_space(raw, HERE)


def test_load_space_names_a_missing_or_broken_file(tmp_path):
    with pytest.raises(SpaceError, match="no such file"):
        load_space(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1\n")
    with pytest.raises(SpaceError, match="not valid YAML"):
        load_space(bad)


def test_probe_values_cover_the_ends_and_a_non_integer_interior():
    uniform = Param("k", "uniform", 1, 3)
    assert uniform.probe_values()[0] == 1.0 and uniform.probe_values()[-1] == 3.0
    assert not uniform.probe_values()[1].is_integer()
    log = Param("k", "log_uniform", 1, 100)  # sqrt(1 * 100) = 10, an integer: moved off it
    assert not log.probe_values()[1].is_integer() and 1 <= log.probe_values()[1] <= 100
    assert Param("k", "int", 2, 5).probe_values() == [2, 5]
    assert Param("k", "categorical", choices=("a", "b")).probe_values() == ["a", "b"]


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "harmofl"])
def test_the_shipped_space_files_parse(name):
    space = load_space(Path("sweeps") / f"{name}.yaml")
    assert space.fixed["data.init_args.val_fraction"] > 0
    assert any(p.kind == "flamby_grid" for p in space.params)
