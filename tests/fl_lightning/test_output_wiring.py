"""Federation wiring of issue 15's output items: progress=false still reports, quiet prints nothing, collapse warned."""

from __future__ import annotations

import warnings

import torch

from fl_lightning.cli import main
from fl_lightning.outputs.collapse import DegenerateTrainingWarning
from tests.conftest import build_federation, tiny_data, tiny_model
from tests.test_configs import TINY  # holds --federation.progress=false

CONFIG = "configs/fedavg_digits.yaml"


def test_progress_false_prints_run_directory_round_lines_and_table(tmp_path, capsys):
    main(["--config", CONFIG, *TINY, "--federation.rounds=2", f"--federation.output_dir={tmp_path}"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("run directory: ") and lines[-1] == lines[0]
    assert [line.split()[1] for line in lines if line.startswith("round ")] == ["1/2", "2/2"]
    assert any("final test" in line for line in lines)


def test_quiet_prints_nothing(tmp_path, capsys):
    main(["--config", CONFIG, *TINY, "--federation.quiet=true", f"--federation.output_dir={tmp_path}"])
    assert capsys.readouterr().out == ""


def test_a_collapsed_run_is_warned_about_and_flagged(tmp_path):
    data = tiny_data()
    model = tiny_model(data, lr=1e-9)  # (almost) no learning: stays collapsed
    with torch.no_grad():  # every image scores class 3 highest
        model.net.classifier.weight.zero_()
        model.net.classifier.bias.copy_(torch.nn.functional.one_hot(torch.tensor(3), 10).float() * 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = build_federation(tmp_path, data=data, model=model, rounds=2).run()
    collapse = summary["collapse"]
    assert collapse["single_class_predictions"] and collapse["balanced_acc_at_chance"]  # num_classes passed
    assert collapse["train_loss_growth"] is False  # client rows passed
    messages = [str(w.message) for w in caught if issubclass(w.category, DegenerateTrainingWarning)]
    assert messages == collapse["messages"] and "single class" in messages[0]


def test_clients_without_test_images_are_warned_about_at_start(tmp_path, monkeypatch):
    fed = build_federation(tmp_path, rounds=1)
    fed.data.setup()
    real = fed.data.num_test_samples
    monkeypatch.setattr(fed.data, "num_test_samples", lambda cid: 0 if cid == "site2" else real(cid))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = fed.run()
    assert any("no test images" in str(w.message) and "site2" in str(w.message) for w in caught)
    assert summary["clients_without_test"] == ["site2"]
