"""metrics.csv / rounds.csv: appended per round, the source of the rows on resume; checkpoints hold only counts."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from fl_lightning.outputs.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from fl_lightning.outputs.run_dir import RunDirectory, _csv_text, parse_cell, read_rows
from tests.conftest import build_federation


def _round(r: int, clients: list[str], evaluated: bool) -> tuple[list[dict], dict]:
    rows = []
    for i, cid in enumerate(clients):
        row = {"round": r, "client": cid, "selected": int(i % 2 == 0), "failed": 0}
        if i % 2 == 0:
            row.update(train_samples=40 + i, train_steps=5, train_loss=1.0 / (r + i + 3))
        if evaluated:
            row.update({"global/acc": 0.1 * i + 1e-17 * r, "global/predicted_classes": float(i + 1)})
        rows.append(row)
    return rows, {"round": r, "selected": 2, "time/train": 0.1 + r / 7, "eval/global/acc": 0.5 + r * 1e-9}


def test_appended_csvs_equal_a_full_rewrite_and_read_back_exactly(tmp_path):
    run = RunDirectory(tmp_path, "r")
    clients = ["0", "7", "site2"]  # client ids that look like numbers stay text
    for r, evaluated in zip(range(1, 6), [False, False, True, False, True]):
        run.add_rows(*_round(r, clients, evaluated))
    run.round_rows[-1]["ddi/rand_index"] = 0.25  # a callback adds a round metric
    run.rewrite_rounds()
    assert (tmp_path / "r" / "metrics.csv").read_text() == _csv_text(run.client_rows)
    assert (tmp_path / "r" / "rounds.csv").read_text() == _csv_text(run.round_rows)
    assert read_rows(tmp_path / "r" / "metrics.csv", len(run.client_rows)) == run.client_rows
    assert read_rows(tmp_path / "r" / "rounds.csv", len(run.round_rows)) == run.round_rows


def test_cells_parse_back_to_what_was_written():
    assert parse_cell("client", "12") == "12"
    assert parse_cell("round", "12") == 12 and isinstance(parse_cell("round", "12"), int)
    assert parse_cell("global/predicted_classes", "3.0") == 3.0 and isinstance(parse_cell("x", "3.0"), float)
    for value in (0.1, 1e-17, -2.5e300, 1 / 3):
        assert parse_cell("train_loss", str(value)) == value
    assert math.isnan(parse_cell("global/auroc", "nan")) and parse_cell("x", "inf") == math.inf
    assert parse_cell("x", "abc") == "abc"


def test_resume_cuts_the_csvs_back_to_the_checkpoint_counts(tmp_path):
    run = RunDirectory(tmp_path, "r")
    clients = ["a", "b", "c"]
    for r in (1, 2):
        run.add_rows(*_round(r, clients, evaluated=r == 2))
    counts = {"clients": len(run.client_rows), "rounds": len(run.round_rows)}
    kept_metrics, kept_rounds = list(run.client_rows), list(run.round_rows)
    expected = (tmp_path / "r" / "metrics.csv").read_text(), (tmp_path / "r" / "rounds.csv").read_text()
    run.add_rows(*_round(3, clients, evaluated=True))
    with open(tmp_path / "r" / "metrics.csv", "a") as f:
        f.write("4,a,1,0,40,5,0.2")  # a row cut short by a kill
    run.close()

    again = RunDirectory.resume(tmp_path / "r", counts)
    assert again.client_rows == kept_metrics and again.round_rows == kept_rounds
    assert ((tmp_path / "r" / "metrics.csv").read_text(), (tmp_path / "r" / "rounds.csv").read_text()) == expected
    again.add_rows(*_round(3, clients, evaluated=True))  # the rerun round appends as the first run did
    assert (tmp_path / "r" / "metrics.csv").read_text() == _csv_text(again.client_rows)
    again.close()

    (tmp_path / "r" / "rounds.csv").write_text("round,selected\n1,2\n")
    with pytest.raises(ValueError, match=r"rounds.csv holds 1 complete rows but the checkpoint counts 3"):
        RunDirectory.resume(tmp_path / "r", {"clients": 9, "rounds": 3})


def test_checkpoints_hold_row_counts_not_rows_and_resume_exactly(tmp_path):
    full = build_federation(tmp_path, rounds=4, keep_checkpoints=0, run_name="full")
    full.run()
    state = load_checkpoint(checkpoint_path(tmp_path / "full", 2))
    assert "rows" not in state and state["row_counts"] == {"clients": 6, "rounds": 2}

    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    resumed = build_federation(
        tmp_path, rounds=4, keep_checkpoints=0, run_name="resumed", resume=str(checkpoint_path(tmp_path / "resumed", 2))
    )
    resumed.run()
    for key, value in full.groups[0].state.items():
        assert torch.equal(value, resumed.groups[0].state[key]), key
    assert resumed.run_dir.client_rows == full.run_dir.client_rows
    assert (tmp_path / "resumed/metrics.csv").read_text() == (tmp_path / "full/metrics.csv").read_text()


def test_a_checkpoint_with_the_rows_themselves_still_resumes(tmp_path):
    """Checkpoints written before they held only counts carried the rows; those rows win over the CSVs."""
    full = build_federation(tmp_path, rounds=3, keep_checkpoints=0, run_name="full")
    full.run()
    shutil.copytree(tmp_path / "full", tmp_path / "old")
    path = checkpoint_path(tmp_path / "old", 2)
    state = load_checkpoint(path)
    counts = state.pop("row_counts")
    state["rows"] = {"clients": full.run_dir.client_rows[: counts["clients"]], "rounds": full.run_dir.round_rows[:2]}
    save_checkpoint(path, state)
    (tmp_path / "old" / "metrics.csv").write_text("garbage\n")
    resumed = build_federation(tmp_path, rounds=3, keep_checkpoints=0, run_name="old", resume=str(path))
    resumed.run()
    assert resumed.run_dir.client_rows == full.run_dir.client_rows
    assert (tmp_path / "old/metrics.csv").read_text() == (tmp_path / "full/metrics.csv").read_text()
