"""Every method that is not image-specific runs on a clinical table through ``train.py``'s main.

Each method runs two rounds on :func:`tests.callbacks.tables.write_table`'s three hospitals with the callbacks (and
federation settings) of its shipped digits config, and one fact of the method is checked where that is cheap,
mostly against a FedAvg run on the same table and seed.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from fl_lightning.cli import main
from tests.callbacks.tables import SITES, table_args

Run = dict[str, Any]  # the summary, plus "rounds": rounds.csv's rows


def _run(tmp_path: Path, name: str, shipped: str | None, model: dict[str, Any] | None = None) -> Run:
    """Two rounds of the method of ``configs/{shipped}.yaml`` (None: FedAvg) on the table; summary and rounds.

    From the shipped overlay come its callbacks and its federation settings (e.g. FedDyn's uniform aggregation);
    its model settings are the digits CNN's (``norm: group`` for DP) and do not apply to a tabular client.
    """
    overlay: dict[str, Any] = {}
    if shipped is not None:
        config = yaml.safe_load(Path("configs", f"{shipped}.yaml").read_text())
        overlay["trainer"] = {"callbacks": config["trainer"]["callbacks"]}
        if "federation" in config:
            overlay["federation"] = config["federation"]
    summary = main(table_args(tmp_path, name, model, **overlay))
    rounds = list(csv.DictReader((tmp_path / "runs" / name / "rounds.csv").open()))
    return {**summary, "rounds": rounds}


@pytest.fixture(scope="module")
def fedavg(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """FedAvg on the table: the reference of the methods that equal it in some respect."""
    return _run(tmp_path_factory.mktemp("fedavg"), "fedavg", None)


# Two runs' losses "differ" by more than this and "agree" within it: rounding moves them by about 1e-8, the weakest
# method term here (FedProx's μ = 0.01 over 3 local steps) by about 1e-5.
LOSS_TOL = 1e-6


def _global_losses(run: Run) -> list[float]:
    """The clients' mean test loss of the global model after each round."""
    return [float(r["eval/global/loss"]) for r in run["rounds"]]


def _nothing_private(run: Run, fedavg: Run) -> None:
    """FedAvg keeps nothing on the clients: each client's personal model is the global one."""
    for metrics in run["clients"].values():
        assert metrics["personal"] == metrics["global"]


def _changes_the_training(run: Run, fedavg: Run) -> None:
    """The method's term or server step changes the models: its losses are not FedAvg's."""
    assert all(abs(a - b) > LOSS_TOL for a, b in zip(_global_losses(run), _global_losses(fedavg)))


def _scaffold(run: Run, fedavg: Run) -> None:
    """The control variates start at 0, so round 1 is FedAvg's; round 2 is corrected by them."""
    (first, second), (reference_first, reference_second) = _global_losses(run), _global_losses(fedavg)
    assert first == pytest.approx(reference_first, abs=LOSS_TOL) and abs(second - reference_second) > LOSS_TOL


def _fednova(run: Run, fedavg: Run) -> None:
    """With the same local steps τ on every client, normalised averaging is FedAvg's (up to rounding)."""
    assert _global_losses(run) == pytest.approx(_global_losses(fedavg), abs=LOSS_TOL)


def _dp_sgd(run: Run, fedavg: Run) -> None:
    """Each client's accountant spent a finite, positive ε on its table rows."""
    epsilons = run["privacy"]["epsilon"]
    assert set(epsilons) == set(SITES) and all(0 < e < math.inf for e in epsilons.values())
    _changes_the_training(run, fedavg)


def _dp_fedavg(run: Run, fedavg: Run) -> None:
    """The server's accountant spent a finite, positive ε; clipped and noised updates are not FedAvg's."""
    assert 0 < run["privacy"]["epsilon"] < math.inf
    _changes_the_training(run, fedavg)


def _secure_aggregation(run: Run, fedavg: Run) -> None:
    """Every client took part in the key exchange; the masks cancel: the sum is FedAvg's up to 32-bit quantisation."""
    assert run["secure_aggregation"]["clients_with_keys"] == len(SITES)
    assert _global_losses(run) == pytest.approx(_global_losses(fedavg), abs=LOSS_TOL)


def _fedbn(run: Run, fedavg: Run) -> None:
    """BatchNorm1d stays private: every client's personal model (its own norm layers) differs from the global one."""
    for metrics in run["clients"].values():
        assert metrics["personal"]["loss"] != metrics["global"]["loss"]


# (id, shipped config with the method's callbacks, tabular client args, the method's fact)
METHODS: list[tuple[str, str | None, dict[str, Any] | None, Callable[[Run, Run], None]]] = [
    ("FedAvg", None, None, _nothing_private),
    ("FedProx", "fedprox_digits", None, _changes_the_training),
    ("Scaffold", "scaffold_digits_dirichlet", None, _scaffold),
    ("FedOpt", "fedadam_digits_dirichlet", None, _changes_the_training),
    ("FedDyn", "feddyn_digits_dirichlet", None, _changes_the_training),
    ("FedNova", "fednova_digits_dirichlet", None, _fednova),
    ("DPSGD", "dpsgd_digits", None, _dp_sgd),
    ("DPFedAvg", "dpfedavg_digits", None, _dp_fedavg),
    ("SecureAggregation", "fedavg_secagg_digits", None, _secure_aggregation),
    ("FedBN", "fedbn_digits", {"arch": "mlp", "norm": "batch", "width": 8}, _fedbn),
]


@pytest.mark.parametrize(("method", "shipped", "model", "fact"), METHODS, ids=[m[0] for m in METHODS])
def test_method_runs_on_a_clinical_table(
    method: str,
    shipped: str | None,
    model: dict[str, Any] | None,
    fact: Callable[[Run, Run], None],
    fedavg: Run,
    tmp_path: Path,
) -> None:
    """Two rounds finish with finite metrics of the global and personal models for every client; the method's fact.

    The run is the method's (the summary lists it), no client failed in either round, and each client's 10 test
    rows (a quarter of 40) are scored.
    """
    run = fedavg if shipped is None else _run(tmp_path, method, shipped, model)

    assert run["methods"] == [method] and run["rounds"] and len(run["rounds"]) == 2
    assert all(r["round/failed_clients"] == "0" for r in run["rounds"])
    assert set(run["clients"]) == set(SITES)
    for metrics in run["clients"].values():
        assert metrics["test_samples"] == 10
        for model_metrics in (metrics["global"], metrics["personal"]):
            assert {"loss", "acc", "auroc"} <= set(model_metrics)
            assert all(math.isfinite(v) for v in model_metrics.values())
    fact(run, fedavg)
