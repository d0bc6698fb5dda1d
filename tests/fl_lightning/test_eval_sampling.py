"""``federation.eval_clients``: a seeded sample of clients evaluated on intermediate rounds, all at the last."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from fl_lightning.config import FederationConfig
from fl_lightning.outputs.config_diff import diff_configs
from fl_lightning.server.selection import evaluation_sample, select_clients
from fl_lightning.wire import protocol
from tests.conftest import build_federation, tiny_data

IDS = [f"site{i}" for i in range(20)]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_sample_is_seeded_sized_in_data_order_and_not_the_training_selection():
    draws = [evaluation_sample(IDS, r, seed=0, eval_clients=5) for r in range(6)]
    assert draws == [evaluation_sample(IDS, r, seed=0, eval_clients=5) for r in range(6)]
    assert all(len(d) == 5 and d == [c for c in IDS if c in d] for d in draws)
    assert len({tuple(d) for d in draws}) > 1  # a fresh sample each round
    assert draws != [evaluation_sample(IDS, r, seed=1, eval_clients=5) for r in range(6)]
    assert draws != [select_clients(IDS, r, 0, 5) for r in range(6)]  # its own stream
    assert len(evaluation_sample(IDS, 0, 0, 0.25)) == 5  # a fraction
    assert len(evaluation_sample(IDS, 0, 0, 0.001)) == 1  # at least one
    assert evaluation_sample(IDS, 0, 0, 50) == IDS  # at most all
    assert evaluation_sample(IDS, 0, 0, 1.0) == IDS


@pytest.mark.parametrize("bad", [0, -1, 0.0, 1.5, True])
def test_invalid_values_are_refused(bad):
    with pytest.raises(ValueError, match="eval_clients"):
        FederationConfig(eval_clients=bad)


def test_a_count_and_a_fraction_are_accepted():
    assert FederationConfig(eval_clients=3).eval_clients == 3
    assert FederationConfig(eval_clients=0.1).eval_clients == 0.1


def _count_evaluate_tasks(fed) -> list[int]:
    """Patch the federation's transport to count the evaluate tasks of each evaluation."""
    counts: list[int] = []
    stream = fed.transport.stream

    def counting(tasks):
        tasks = list(tasks)
        n = sum(t.kind == protocol.EVALUATE for t in tasks)
        if n:
            counts.append(n)
        return stream(tasks)

    fed.transport.stream = counting
    return counts


def test_sampled_rounds_evaluate_only_the_sample_and_training_is_unchanged(tmp_path):
    data = tiny_data(num_clients=6)
    full = build_federation(tmp_path, data=data, rounds=3, run_name="full")
    full.run()
    sampled = build_federation(tmp_path, data=tiny_data(num_clients=6), rounds=3, run_name="sampled", eval_clients=2)
    tasks = _count_evaluate_tasks(sampled)
    sampled.run()

    assert tasks == [2, 2, 6]  # per-round evaluation cost follows the sample; the last round evaluates everyone
    for key, value in full.groups[0].state.items():  # evaluation never trains
        assert torch.equal(value, sampled.groups[0].state[key]), key
    rows = read_csv(tmp_path / "sampled" / "metrics.csv")
    ids = list(data.client_ids)
    for r in (1, 2):
        evaluated = [row["client"] for row in rows if row["round"] == str(r) and row["global/acc"] != ""]
        assert evaluated == evaluation_sample(ids, r - 1, 0, 2)
        assert len([row for row in rows if row["round"] == str(r)]) == 6  # unevaluated clients keep their rows
    assert all(row["global/acc"] != "" for row in rows if row["round"] == "3")
    rounds = read_csv(tmp_path / "sampled" / "rounds.csv")
    assert [row["round/evaluated_clients"] for row in rounds] == ["2", "2", "6"]
    assert "round/evaluated_clients" not in read_csv(tmp_path / "full" / "rounds.csv")[0]  # unchanged when off
    # the final table is over all clients, and the same as without sampling
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("full", "sampled")]
    for s in summaries:
        s.pop("run_dir")
    assert summaries[0] == summaries[1]
    # the full run's rows are the sampled run's wherever the sampled run evaluated
    full_rows = read_csv(tmp_path / "full" / "metrics.csv")
    for a, b in zip(full_rows, rows):
        assert {k: v for k, v in b.items() if v != "" and not k.startswith("time")} == {
            k: a[k] for k, v in b.items() if v != "" and not k.startswith("time")
        }


def test_eval_clients_may_change_on_resume():
    saved = {"federation": {"eval_clients": None, "rounds": 3}}
    diff = diff_configs(saved, {"federation": {"eval_clients": 0.1, "rounds": 3}})
    assert diff.refused == {} and set(diff.allowed) == {"federation.eval_clients"}


@pytest.mark.parametrize(("arg", "value"), [("0.1", 0.1), ("100", 100), ("null", None), ("1.0", 1.0)])
def test_the_command_line_reads_a_count_or_a_fraction(arg, value):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(FederationConfig, "federation")
    cfg = parser.instantiate(parser.parse_args([f"--federation.eval_clients={arg}"]))
    assert cfg.federation.eval_clients == value and type(cfg.federation.eval_clients) is type(value)
