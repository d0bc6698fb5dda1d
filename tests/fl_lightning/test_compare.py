"""The run comparison: grouping by method, mean ± std over seeds, refusals, the written files, a real pair of runs."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fl_lightning.tools import compare
from fl_lightning.tools.compare import CompareRefused, load_run, main, method_name

CLASSIFIER = "fl_lightning.clients.ClassificationClient"
SEGMENTER = "fl_lightning.clients.SegmentationClient"

BASE_CONFIG: dict[str, Any] = {
    "seed_everything": 0,
    "trainer": {"accelerator": "auto", "devices": 1, "logger": False, "callbacks": None},
    "model": {"class_path": CLASSIFIER, "init_args": {"arch": "cnn", "width": 4, "lr": 0.05}},
    "data": {"class_path": "datamodules.DigitsFederated", "init_args": {"num_clients": 5, "image_size": 8, "seed": 0}},
    "federation": {"rounds": 3, "mode": "federated", "run_name": "x", "output_dir": "runs", "progress": False},
}
CALLBACKS = {"FedBN": {"class_path": "callbacks.FedBN"}, "FedProx": {"class_path": "callbacks.FedProx"}}


def stats(mean: float, worst: float) -> dict[str, Any]:
    return {"mean": mean, "std": 0.05, "worst": worst, "worst_client": "site0"}


def write_run(
    root: Path,
    name: str,
    seed: int,
    values: dict[str, float],
    curve: list[float],
    methods: tuple[str, ...] = ("FedAvg",),
    mode: str = "federated",
    collapsed: bool | None = False,
    config: dict[str, Any] | None = None,
    metric: str = "acc",
) -> Path:
    """A fake run directory: config.yaml, summary.json and rounds.csv holding the given numbers.

    ``values`` holds any of global_mean, global_worst, personal_mean, personal_worst, pooled; ``curve`` the
    client mean of ``eval/global/<metric>`` (``eval/personal/`` without a global model) per round.
    """
    run = root / name
    run.mkdir(parents=True)
    cfg = copy.deepcopy(config or BASE_CONFIG)
    cfg["seed_everything"] = seed
    cfg["federation"].update(mode=mode, run_name=name, output_dir=str(root))
    callbacks = [CALLBACKS[m] for m in methods if m in CALLBACKS]
    cfg["trainer"]["callbacks"] = callbacks or None
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary: dict[str, Any] = {"methods": list(methods), "mode": mode, "topology": "star", "rounds": len(curve)}
    summary["summary"] = {
        model: {metric: stats(values[f"{model}_mean"], values[f"{model}_worst"]), "loss": stats(1.0, 2.0)}
        for model in ("global", "personal")
        if f"{model}_mean" in values
    }
    if "pooled" in values:
        summary["pooled"] = {metric: values["pooled"], "loss": 1.0}
    if collapsed is not None:
        summary["collapse"] = {"detected": collapsed, "messages": ["it collapsed"] if collapsed else []}
    (run / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    column = f"eval/{'global' if 'global_mean' in values else 'personal'}/{metric}"
    with open(run / "rounds.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "time/round", column])
        writer.writerows([r + 1, 0.5, v] for r, v in enumerate(curve))
    return run


# two methods: FedAvg with three seeds, FedBN with two (values per seed)
FEDAVG = [
    {"global_mean": 0.70, "global_worst": 0.50, "personal_mean": 0.70, "personal_worst": 0.50, "pooled": 0.72},
    {"global_mean": 0.80, "global_worst": 0.55, "personal_mean": 0.80, "personal_worst": 0.55, "pooled": 0.79},
    {"global_mean": 0.75, "global_worst": 0.65, "personal_mean": 0.75, "personal_worst": 0.65, "pooled": 0.77},
]
FEDBN = [
    {"global_mean": 0.60, "global_worst": 0.40, "personal_mean": 0.85, "personal_worst": 0.70, "pooled": 0.61},
    {"global_mean": 0.66, "global_worst": 0.30, "personal_mean": 0.90, "personal_worst": 0.80, "pooled": 0.64},
]
CURVES = {"FedAvg": [[0.3, 0.5, 0.7], [0.4, 0.6, 0.8], [0.2, 0.5, 0.75]], "FedBN": [[0.5, 0.55, 0.6], [0.3, 0.6, 0.66]]}


@pytest.fixture
def two_methods(tmp_path: Path) -> list[Path]:
    runs = [write_run(tmp_path, f"fedavg-{s}", s, v, CURVES["FedAvg"][s]) for s, v in enumerate(FEDAVG)]
    runs += [
        write_run(tmp_path, f"fedbn-{s}", s, v, CURVES["FedBN"][s], methods=("FedBN",), collapsed=s == 1)
        for s, v in enumerate(FEDBN)
    ]
    return runs


def test_runs_are_grouped_by_method_with_mean_and_sample_std_over_seeds(two_methods):
    result = compare.compare([load_run(p) for p in reversed(two_methods)])
    assert result["metric"] == "acc"
    assert list(result["methods"]) == ["FedBN", "FedAvg"]  # in the order given
    fedavg, fedbn = result["methods"]["FedAvg"], result["methods"]["FedBN"]
    assert fedavg["seeds"] == [0, 1, 2] and fedbn["seeds"] == [0, 1]  # sorted by seed within a method
    for entry, per_seed in ((fedavg, FEDAVG), (fedbn, FEDBN)):
        for column in ("global_mean", "global_worst", "personal_mean", "personal_worst", "pooled"):
            values = np.array([v[column] for v in per_seed])
            got = entry["stats"][column]
            assert got["mean"] == pytest.approx(values.mean()), column
            assert got["std"] == pytest.approx(values.std(ddof=1)), column
            assert got["n"] == len(values)
            assert [r["values"][column] for r in entry["runs"]] == pytest.approx(list(values))
    assert fedavg["stats"]["global_mean"]["std"] == pytest.approx(0.05)  # by hand: (0.7, 0.8, 0.75)
    assert fedavg["collapsed"] == {"count": 0, "of": 3, "unknown": 0, "seeds": []}
    assert fedbn["collapsed"] == {"count": 1, "of": 2, "unknown": 0, "seeds": [1]}
    curves = np.array(CURVES["FedAvg"])
    assert fedavg["curve"]["model"] == "global" and fedavg["curve"]["rounds"] == [1, 2, 3]
    assert fedavg["curve"]["mean"] == pytest.approx(list(curves.mean(axis=0)))
    assert fedavg["curve"]["std"] == pytest.approx(list(curves.std(axis=0, ddof=1)))


def test_the_table_shows_mean_plus_minus_std_and_the_collapses(two_methods):
    result = compare.compare([load_run(p) for p in two_methods])
    header, rows = compare.table_rows(result)
    assert header == [
        "method",
        "seeds",
        "global mean client acc",
        "global worst client acc",
        "personal mean client acc",
        "personal worst client acc",
        "pooled acc",
        "collapsed",
    ]
    worst = np.array([v["global_worst"] for v in FEDBN])
    assert rows[0][:3] == ["FedAvg", "3 (0, 1, 2)", "0.7500 ± 0.0500"]
    assert rows[1][3] == f"{worst.mean():.4f} ± {worst.std(ddof=1):.4f}"
    assert rows[0][-1] == "0 of 3" and rows[1][-1] == "1 of 2 (seed 1)"
    text = compare.markdown(result)
    assert "ddof=1" in text and "| FedAvg | 3 (0, 1, 2) | 0.7500 ± 0.0500 |" in text


def test_one_seed_shows_the_value_alone(tmp_path):
    run = write_run(tmp_path, "a", 3, FEDAVG[0], [0.4, 0.7])
    result = compare.compare([load_run(run)])
    stat = result["methods"]["FedAvg"]["stats"]["global_mean"]
    assert stat == {"mean": pytest.approx(0.70), "std": None, "n": 1}
    _, rows = compare.table_rows(result)
    assert rows == [["FedAvg", "1 (3)", "0.7000", "0.5000", "0.7000", "0.5000", "0.7200", "0 of 1"]]
    assert result["methods"]["FedAvg"]["curve"]["std"] == [None, None]


def test_method_names():
    assert method_name({"methods": ["FedAvg"], "mode": "federated"}) == "FedAvg"
    assert method_name({"methods": ["FedBN", "FedProx"], "mode": "federated"}) == "FedBN+FedProx"
    assert method_name({"methods": ["FedAvg"], "mode": "local"}) == "local"
    assert method_name({"methods": ["FedAvg"], "mode": "centralized"}) == "centralized"
    assert method_name({"methods": ["FedProx"], "mode": "local"}) == "FedProx (local)"


def test_columns_no_run_has_are_left_out_and_a_local_run_is_its_own_row(tmp_path):
    fed = write_run(tmp_path, "fed", 0, {"global_mean": 0.7, "global_worst": 0.5}, [0.5, 0.7])
    local = write_run(tmp_path, "local", 0, {"personal_mean": 0.6, "personal_worst": 0.4}, [0.5, 0.6], mode="local")
    result = compare.compare([load_run(fed), load_run(local)])
    assert list(result["columns"]) == ["global_mean", "global_worst", "personal_mean", "personal_worst"]
    _, rows = compare.table_rows(result)
    assert rows == [
        ["FedAvg", "1 (0)", "0.7000", "0.5000", "–", "–", "0 of 1"],
        ["local", "1 (0)", "–", "–", "0.6000", "0.4000", "0 of 1"],
    ]
    assert result["methods"]["local"]["curve"]["model"] == "personal"


def test_metric_override_and_an_unknown_metric(two_methods):
    runs = [load_run(p) for p in two_methods]
    loss = compare.compare(runs, metric="loss")["methods"]["FedAvg"]["stats"]["global_mean"]
    assert loss == {"mean": pytest.approx(1.0), "std": pytest.approx(0.0), "n": 3}
    with pytest.raises(CompareRefused, match="'dice'.*they hold: acc, loss"):
        compare.compare(runs, metric="dice")


def test_segmentation_defaults_to_dice_although_summary_json_sorts_acc_first(tmp_path):
    config = copy.deepcopy(BASE_CONFIG)
    config["model"] = {"class_path": SEGMENTER, "init_args": {"arch": "unet", "width": 4}}
    run = tmp_path / "seg"
    write_run(tmp_path, "seg", 0, {"global_mean": 0.6, "global_worst": 0.4}, [0.6], config=config, metric="dice")
    summary = json.loads((run / "summary.json").read_text())
    summary["summary"]["global"]["acc"] = stats(0.95, 0.9)  # pixel accuracy: first in the sorted file
    (run / "summary.json").write_text(json.dumps(summary, sort_keys=True))
    assert compare.default_metric([load_run(run)]) == "dice"


def test_runs_of_different_tasks_are_refused_naming_the_key_and_each_value(tmp_path, capsys):
    a = write_run(tmp_path, "a", 0, FEDAVG[0], [0.7])
    config = copy.deepcopy(BASE_CONFIG)
    config["data"]["init_args"]["image_size"] = 16
    b = write_run(tmp_path, "b", 1, FEDAVG[1], [0.8], methods=("FedBN",), config=config)
    with pytest.raises(CompareRefused) as err:
        compare.compare([load_run(a), load_run(b)])
    message = str(err.value)
    assert "data.init_args.image_size" in message
    assert f"{a}: 8" in message and f"{b}: 16" in message
    # the method, the seed, the run name and the output directory differ too, and may
    assert "seed_everything" not in message and "trainer.callbacks" not in message and "run_name" not in message
    assert main([str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    assert "data.init_args.image_size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # a setting the user allows may differ
    result = compare.compare([load_run(a), load_run(b)], allow=["data.init_args.image_size"])
    assert list(result["methods"]) == ["FedAvg", "FedBN"]


def test_two_runs_of_one_method_with_the_same_seed_are_refused_naming_both(tmp_path, capsys):
    a = write_run(tmp_path, "a", 0, FEDAVG[0], [0.7])
    b = write_run(tmp_path, "b", 0, FEDAVG[1], [0.8])
    with pytest.raises(CompareRefused, match=f"{a} and {b} are both FedAvg with seed 0"):
        compare.compare([load_run(a), load_run(b)])
    assert main([str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    assert "duplicates" in capsys.readouterr().err
    with pytest.raises(CompareRefused, match="given twice"):
        compare.compare([load_run(a), load_run(a)])
    # the same seed under another method is the paired comparison, not a duplicate
    c = write_run(tmp_path, "c", 0, FEDBN[0], [0.6], methods=("FedBN",))
    assert set(compare.compare([load_run(a), load_run(c)])["methods"]) == {"FedAvg", "FedBN"}


def test_a_missing_or_unreadable_record_names_the_run_directory(tmp_path, capsys):
    run = write_run(tmp_path, "unfinished", 0, FEDAVG[0], [0.7])
    (run / "summary.json").unlink()
    with pytest.raises(CompareRefused, match=f"{run}: no summary.json"):
        load_run(run)
    assert main([str(run)]) == 2
    assert f"{run}: no summary.json" in capsys.readouterr().err
    other = write_run(tmp_path, "noconfig", 0, FEDAVG[0], [0.7])
    (other / "config.yaml").unlink()
    with pytest.raises(CompareRefused, match=f"{other}: no config.yaml"):
        load_run(other)
    broken = write_run(tmp_path, "broken", 0, FEDAVG[0], [0.7])
    (broken / "summary.json").write_text("{not json")
    with pytest.raises(CompareRefused, match=f"{broken}: summary.json is unreadable"):
        load_run(broken)
    with pytest.raises(CompareRefused, match="not a directory"):
        load_run(tmp_path / "nowhere")


def test_main_prints_the_table_and_writes_markdown_json_and_png(two_methods, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main([*map(str, two_methods), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "0.7500 ± 0.0500" in printed and "ddof=1" in printed and "1 of 2 (seed 1)" in printed
    assert {p.name for p in out.iterdir()} == {"comparison.md", "comparison.json", "comparison.png"}
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "comparison.json").read_text())
    assert saved["methods"]["FedBN"]["stats"]["personal_mean"]["std"] == pytest.approx(np.std([0.85, 0.9], ddof=1))
    assert [r["seed"] for r in saved["methods"]["FedAvg"]["runs"]] == [0, 1, 2]
    assert "| FedBN | 2 (0, 1) |" in (out / "comparison.md").read_text()


def test_the_default_output_folder_is_comparison_under_the_current_directory(two_methods, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([str(p) for p in two_methods[:2]]) == 0
    assert (tmp_path / "comparison" / "comparison.md").is_file()


@pytest.mark.filterwarnings("ignore::fl_lightning.outputs.collapse.DegenerateTrainingWarning")  # 2 tiny rounds
def test_two_real_fedavg_seeds_compare_end_to_end(tmp_path):
    from fl_lightning.cli import main as train

    common = [
        "--config",
        "configs/fedavg_digits.yaml",
        "--trainer.logger=false",
        "--federation.rounds=2",
        "--federation.progress=false",
        "--federation.quiet=true",
        "--federation.plots=false",
        "--federation.checkpoint_every=0",
        "--data.max_samples_per_client=30",
        "--data.image_size=8",
        "--model.width=4",
        f"--federation.output_dir={tmp_path}",
    ]
    summaries = {
        seed: train([*common, f"--seed_everything={seed}", f"--federation.run_name=s{seed}"]) for seed in (0, 1)
    }
    out = tmp_path / "cmp"
    assert main([str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(out)]) == 0
    saved = json.loads((out / "comparison.json").read_text())
    assert saved["metric"] == "acc" and list(saved["methods"]) == ["FedAvg"]
    fedavg = saved["methods"]["FedAvg"]
    assert fedavg["seeds"] == [0, 1]
    values = [summaries[s]["summary"]["global"]["acc"]["mean"] for s in (0, 1)]
    assert fedavg["stats"]["global_mean"]["mean"] == pytest.approx(np.mean(values))
    assert fedavg["stats"]["global_mean"]["std"] == pytest.approx(np.std(values, ddof=1))
    pooled = [summaries[s]["pooled"]["acc"] for s in (0, 1)]
    assert fedavg["stats"]["pooled"]["mean"] == pytest.approx(np.mean(pooled))
    assert fedavg["curve"]["rounds"] == [1, 2]
    assert (out / "comparison.png").is_file() and (out / "comparison.md").is_file()


def test_runs_of_different_length_are_never_seeds_of_one_setting(tmp_path):
    """Failed before: config.yaml keeps the first start's rounds, so a resume that added rounds compared as equal."""
    config = copy.deepcopy(BASE_CONFIG)
    config["federation"]["rounds"] = 2  # what a run started with 2 rounds and resumed to 3 still says
    resumed = write_run(tmp_path, "resumed", 0, FEDAVG[0], [0.3, 0.5, 0.7], config=config)
    short = write_run(tmp_path, "short", 1, FEDAVG[1], [0.4, 0.6], config=config)
    with pytest.raises(CompareRefused, match=r"federation.rounds:\n.*resumed: 3\n.*short: 2"):
        compare.compare([load_run(resumed), load_run(short)])
    plain = write_run(tmp_path, "plain", 2, FEDAVG[2], [0.2, 0.5, 0.75])  # 3 rounds, as its config says
    assert compare.compare([load_run(resumed), load_run(plain)])["methods"]["FedAvg"]  # two seeds of 3 rounds


def test_a_message_of_a_run_that_did_not_collapse_is_not_called_a_collapse(tmp_path):
    """Failed before: the footnotes said "collapsed:" for a run whose summary.json says detected: false."""
    from fl_lightning.tools.compare.table import notes

    recovered = write_run(tmp_path, "recovered", 0, FEDAVG[0], [0.1, 0.7])
    summary = json.loads((recovered / "summary.json").read_text())
    summary["collapse"] = {"detected": False, "messages": ["one class in round(s) 1 before it recovered"]}
    (recovered / "summary.json").write_text(json.dumps(summary))
    collapsed = write_run(tmp_path, "collapsed", 1, FEDAVG[1], [0.1, 0.1], collapsed=True)
    lines = notes(compare.compare([load_run(recovered), load_run(collapsed)]))
    assert any("seed 0" in line and "did not collapse, but: one class in round(s) 1" in line for line in lines)
    assert not any("seed 0" in line and "collapsed:" in line for line in lines)
    assert any("seed 1" in line and "collapsed: it collapsed" in line for line in lines)


def test_runs_differing_only_in_their_seeds_are_replicates(tmp_path):
    """Failed before: a different data.seed (each seed's own split) was refused as a differing setting."""
    runs = []
    for s in range(2):
        config = copy.deepcopy(BASE_CONFIG)
        config["data"]["init_args"]["seed"] = s
        runs.append(write_run(tmp_path, f"s{s}", s, FEDAVG[s], CURVES["FedAvg"][s], config=config))
    result = compare.compare([load_run(r) for r in runs])
    assert result["methods"]["FedAvg"]["seeds"] == [0, 1]
    config = copy.deepcopy(BASE_CONFIG)
    config["data"]["init_args"]["seed"] = 1  # same seed_everything, another split: still a replicate
    other_split = write_run(tmp_path, "split1", 0, FEDAVG[2], CURVES["FedAvg"][2], config=config)
    assert len(compare.compare([load_run(runs[0]), load_run(other_split)])["methods"]["FedAvg"]["runs"]) == 2


def fedprox_run(root: Path, name: str, seed: int, mu: float) -> Path:
    run = write_run(root, name, seed, FEDAVG[seed], CURVES["FedAvg"][seed], methods=("FedProx",))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["trainer"]["callbacks"] = [{"class_path": "callbacks.FedProx", "init_args": {"mu": mu}}]
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    return run


def test_one_method_with_different_arguments_is_two_rows(tmp_path):
    """Failed before: FedProx with mu 0.01 and mu 0.1 at one seed were refused as duplicates of one method."""
    low, high = fedprox_run(tmp_path, "mu1", 0, 0.01), fedprox_run(tmp_path, "mu2", 0, 0.1)
    methods = compare.compare([load_run(low), load_run(high)])["methods"]
    assert sorted(methods) == ["FedProx (FedProx.mu=0.01)", "FedProx (FedProx.mu=0.1)"]
    again = fedprox_run(tmp_path, "again", 0, 0.01)
    with pytest.raises(CompareRefused, match="duplicates"):  # the same arguments at the same seed still are
        compare.compare([load_run(low), load_run(again)])
    seeds = compare.compare([load_run(low), load_run(fedprox_run(tmp_path, "seed1", 1, 0.01))])["methods"]
    assert list(seeds) == ["FedProx"]  # equal arguments: one row, two seeds


def test_runs_chosen_on_validation_show_the_monitor_its_value_and_the_rounds(tmp_path):
    runs = [write_run(tmp_path, f"fedavg-{s}", s, v, CURVES["FedAvg"][s]) for s, v in enumerate(FEDAVG[:2])]
    for run, (value, chosen) in zip(runs, [(0.81, 2), (0.83, 3)], strict=True):
        summary = json.loads((run / "summary.json").read_text())
        summary["selection"] = {"select": "best", "monitor": "val/acc_mean", "round": chosen, "value": value}
        (run / "summary.json").write_text(json.dumps(summary))
    result = compare.compare([load_run(r) for r in runs])
    entry = result["methods"]["FedAvg"]
    assert entry["selection"]["monitor"] == ["val/acc_mean"] and entry["selection"]["rounds"] == [2, 3]
    assert entry["selection"]["value"]["mean"] == pytest.approx(0.82)
    header, rows = compare.table.table_rows(result)
    assert "chosen on (validation)" in header
    assert rows[0][header.index("chosen on (validation)")].startswith("val/acc_mean 0.8200 ± 0.0141 at rounds 2, 3")
    plain = compare.compare([load_run(write_run(tmp_path / "plain", "a", 0, FEDAVG[0], [0.5]))])
    assert "chosen on (validation)" not in compare.table.table_rows(plain)[0]
