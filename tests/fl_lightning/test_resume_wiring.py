"""End to end through the CLI: resume refuses another config, records allowed changes, never mixes runs.

Every test here except ``test_reusing_a_run_name_is_refused_and_the_first_run_kept`` needs the Federation to call
``resolve_resume(..., config_dict)``, ``check_clients_match``, ``check_resume_config`` and
``RunDirectory.record_resume`` in ``Federation._open_run_dir``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fl_lightning.cli import main
from fl_lightning.outputs.checkpoint import list_checkpoints
from tests.conftest import build_federation, tiny_data

REPO = Path(__file__).resolve().parents[2]


def small(out: Path, name: str | None, *extra: str, rounds: int = 2) -> list[str]:
    """A two-round run on tiny digits; ``extra`` after the defaults, so it overrides them."""
    args = [
        "--config", str(REPO / "configs/fedavg_digits.yaml"),
        "--trainer.logger=false",
        f"--federation.rounds={rounds}",
        "--federation.progress=false",
        "--federation.plots=false",
        "--federation.keep_checkpoints=0",
        "--data.max_samples_per_client=40",
        "--data.image_size=8",
        "--data.num_clients=3",
        "--model.width=4",
        f"--federation.output_dir={out}",
        *extra,
    ]  # fmt: skip
    return [*args, f"--federation.run_name={name}"] if name is not None else args


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("--data.seed=1", "data.init_args.seed: 0 -> 1"),
        ("--data.partition=dirichlet", "data.init_args.partition: 'iid' -> 'dirichlet'"),
        ("--model.lr=0.2", "model.init_args.lr: 0.05 -> 0.2"),
        ("--federation.mode=local", "federation.mode: 'federated' -> 'local'"),
        ("--data.num_clients=4", "data.init_args.num_clients: 3 -> 4"),
    ],
)
def test_resume_with_settings_that_change_training_is_refused(tmp_path, change, key):
    main(small(tmp_path, "exp"))
    before = sorted(p.name for p in (tmp_path / "exp").rglob("*"))
    with pytest.raises(ValueError, match="config.yaml in settings that change what is trained") as exc:
        main(small(tmp_path, "exp", change, "--federation.resume=last", rounds=3))
    assert key in str(exc.value)
    assert sorted(p.name for p in (tmp_path / "exp").rglob("*")) == before  # nothing was written


def test_allowed_changes_resume_and_are_recorded(tmp_path):
    main(small(tmp_path, "exp"))
    summary = main(small(tmp_path, "exp", "--federation.resume=last", "--federation.eval_every=2", rounds=3))
    assert summary["rounds"] == 3
    record = json.loads((tmp_path / "exp" / "resume_changes.json").read_text())
    assert len(record) == 1 and record[0]["after_round"] == 2
    assert record[0]["changes"]["federation.rounds"] == {"saved": 2, "now": 3}
    assert record[0]["changes"]["federation.eval_every"] == {"saved": 1, "now": 2}
    assert "federation.resume" in record[0]["changes"]


def test_resume_last_without_a_name_continues_only_the_matching_run(tmp_path):
    main(small(tmp_path, "mine"))
    main(small(tmp_path, "other-seed", "--data.seed=1"))  # newer, but another experiment
    summary = main(small(tmp_path, None, "--federation.resume=last", rounds=3))
    assert Path(summary["run_dir"]).name == "mine"
    assert [p.name for p in list_checkpoints(tmp_path / "other-seed")][0] == "round-00002.ckpt"
    with pytest.raises(ValueError, match=r"(?s)candidates.*other-seed: differs in .*model\.init_args\.lr"):
        main(small(tmp_path, None, "--model.lr=0.3", "--federation.resume=last", rounds=3))


def test_reusing_a_run_name_is_refused_and_the_first_run_kept(tmp_path):
    main(small(tmp_path, "exp", rounds=3))
    kept = (tmp_path / "exp" / "summary.json").read_text()
    with pytest.raises(FileExistsError, match=r"exp exists already .*--federation.resume=last"):
        main(small(tmp_path, "exp", "--data.seed=1"))
    assert (tmp_path / "exp" / "summary.json").read_text() == kept
    assert list_checkpoints(tmp_path / "exp")[0].name == "round-00003.ckpt"


def test_a_checkpoint_of_other_clients_is_refused_naming_both_lists(tmp_path):
    build_federation(tmp_path, rounds=1, run_name="r").run()  # 3 clients
    again = build_federation(tmp_path, data=tiny_data(num_clients=4), rounds=2, run_name="r", resume="last")
    with pytest.raises(ValueError, match=r"3 clients \[site0, site1, site2\] but the data has 4 clients \[.*site3\]"):
        again.run()
