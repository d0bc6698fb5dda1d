"""What a run prints: a bar only on a terminal, the report (run directory, round lines, table) always; quiet: none."""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from fl_lightning.config import FederationConfig
from fl_lightning.outputs import records
from fl_lightning.outputs.records import round_line
from fl_lightning.outputs.report import RoundReporter, evaluation_table, privacy_line, table_notes
from tests.conftest import build_federation


def log_file_console() -> tuple[Console, io.StringIO]:
    """A console writing to a file, as stdout is in a SLURM job: not a terminal, 80 columns."""
    out = io.StringIO()
    return Console(file=out, width=80), out


def terminal_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=80, force_terminal=True), out


def stats(mean: float, worst: float) -> dict[str, float]:
    return {"mean": mean, "std": 0.05, "worst": worst, "worst_client": "site1"}


CLASSIFICATION = {
    "summary": {
        "global": {"acc": stats(0.8123, 0.701), "balanced_acc": stats(0.70, 0.6), "auroc": stats(0.9, 0.8)},
        "personal": {"acc": stats(0.8123, 0.701), "balanced_acc": stats(0.70, 0.6), "auroc": stats(0.9, 0.8)},
    },
    "pooled": {"acc": 0.8, "balanced_acc": 0.79, "auroc": 0.9123},
}


# ------------------------------------------------------------------------------------------ the reporter


@pytest.mark.parametrize(
    ("progress", "terminal", "bar"),
    [(None, False, False), (None, True, True), (False, True, False), (True, False, True)],
)
def test_bar_only_on_a_terminal_by_default(progress, terminal, bar):
    console, _ = terminal_console() if terminal else log_file_console()
    reporter = RoundReporter.from_config(FederationConfig(progress=progress), console=console)
    assert reporter.bar is bar and reporter.enabled


@pytest.mark.parametrize("progress", [None, False])
def test_without_bar_the_report_is_still_printed(progress):
    console, out = log_file_console()
    reporter = RoundReporter.from_config(FederationConfig(progress=progress), console=console)
    reporter.start(2, "runs/my-run")
    for r in (1, 2):
        reporter.round_start(3)
        reporter.client_done()
        reporter.round_end(f"round {r}/2  loss 0.5")
    reporter.note("resuming from somewhere")
    text = out.getvalue()
    assert text.splitlines()[:3] == ["run directory: runs/my-run", "round 1/2  loss 0.5", "round 2/2  loss 0.5"]
    assert "resuming from somewhere" in text
    assert "\x1b[" not in text  # no bar frames or colour codes in a log file


def test_quiet_prints_nothing_even_with_the_bar_asked_for():
    console, out = terminal_console()
    reporter = RoundReporter.from_config(FederationConfig(progress=True, quiet=True), console=console)
    reporter.start(1, "runs/x")
    reporter.round_start(1)
    reporter.client_done()
    reporter.round_end("round 1/1")
    reporter.note("note")
    reporter.finish({"clients": {}, "summary": {}}, "runs/x")
    assert out.getvalue() == "" and not reporter.bar


def test_long_round_lines_are_not_wrapped_in_a_log_file():
    console, out = log_file_console()
    reporter = RoundReporter(console=console, bar=False)
    line = "round 3/10  " + "  ".join(f"model{i} acc 0.812 worst 0.701" for i in range(5))  # ≈ 150 characters
    reporter.round_end(line)
    reporter.note("[bold]a note[/bold] with brackets from " + "a/very/long/path/" * 8)
    lines = out.getvalue().splitlines()
    assert lines[0] == line
    assert lines[1].startswith("[bold]a note[/bold]") and len(lines) == 2


def test_progress_false_run_prints_run_directory_round_lines_and_table(tmp_path):
    fed = build_federation(tmp_path, rounds=2, progress=False, quiet=False)
    console, out = log_file_console()
    fed.reporter = RoundReporter.from_config(fed.config, console=console)
    fed.run()
    lines = out.getvalue().splitlines()
    assert lines[0] == f"run directory: {fed.run_dir.path}"
    round_lines = [line for line in lines if line.startswith("round ")]
    assert [line.split()[1] for line in round_lines] == ["1/2", "2/2"]
    # once, above the first round line: which numbers are over clients and which over the pooled test set
    legend = [i for i, line in enumerate(lines) if line.startswith("legend: ")]
    assert len(legend) == 1 and lines[legend[0] + 1].startswith("round 1/2")
    assert (
        "acc, worst: mean and worst client" in lines[legend[0]] and "bacc, auroc: pooled test set" in lines[legend[0]]
    )
    assert all("bacc" in line and "auroc" in line for line in round_lines)
    assert all(len(line) <= 80 for line in round_lines), round_lines
    assert any("final test" in line for line in lines)
    assert lines[-1] == f"run directory: {fed.run_dir.path}"


# ------------------------------------------------------------------------------------------ the round line


def test_round_line_shows_balanced_accuracy_and_auroc_within_80_columns():
    line = round_line(100, 100, {"a": {"train_loss": 0.41234}}, CLASSIFICATION, 123.4)
    assert line == "round 100/100  loss 0.412  acc 0.812 worst 0.701  bacc 0.790  auroc 0.912  123s"
    assert len(line) <= 80
    diverged = round_line(100, 100, {"a": {"train_loss": 2.4e7}}, CLASSIFICATION, 99.96)
    assert "loss 2.4e7" in diverged and len(diverged) <= 80


def test_round_line_names_models_when_personal_differs_and_uses_client_means_without_pooled():
    evaluation = {
        "summary": {
            **CLASSIFICATION["summary"],
            "personal": {"acc": stats(0.85, 0.78), "balanced_acc": stats(0.8, 0.7)},
        }
    }
    line = round_line(3, 10, {"a": {"train_loss": 1.0}, "b": {"train_loss": 2.0}}, evaluation, 1.23)
    assert line == (
        "round 3/10  loss 1.5  global acc 0.812 worst 0.701  personal acc 0.850 worst 0.780  bacc 0.700  "
        "auroc 0.900  1.2s"
    )


def test_the_legend_says_client_means_where_there_is_no_pooled_test_set():
    without_pooled = {k: v for k, v in CLASSIFICATION.items() if k != "pooled"}
    assert records.round_legend(without_pooled).endswith("bacc, auroc: mean over clients")
    assert records.round_legend({"summary": {}}) is None


def test_segmentation_round_line_has_no_classification_extras():
    evaluation = {"summary": {"global": {"dice": stats(0.6, 0.4), "acc": stats(0.9, 0.8)}}, "pooled": {"dice": 0.6}}
    line = round_line(1, 2, {"a": {"train_loss": 0.3}}, evaluation, 0.5, metric="dice")
    assert line == "round 1/2  loss 0.3  dice 0.600 worst 0.400  0.5s"


# ------------------------------------------------------------------------------------------ the final table


def render(table) -> str:
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(table)
    return console.export_text()


def summary_of(evaluation: dict, test_samples: dict[str, int]) -> dict:
    per_client = {"acc": 0.8, "balanced_acc": 0.7, "auroc": 0.9, "loss": 0.4}
    clients = {
        cid: {"test_samples": n, **({"global": per_client, "personal": per_client} if n else {})}
        for cid, n in test_samples.items()
    }
    return {
        "clients": clients,
        "summary": evaluation["summary"],
        "pooled": evaluation["pooled"],
        "pooled_test_samples": sum(test_samples.values()),
        "clients_without_test": [c for c, n in test_samples.items() if n == 0],
        "collapse": {"messages": ["the global model predicts a single class"]},
    }


def test_final_table_shows_balanced_accuracy_and_auroc_next_to_accuracy():
    text = render(evaluation_table(summary_of(CLASSIFICATION, {"site0": 10, "site1": 0})))
    header = next(line for line in text.splitlines() if "global acc" in line)
    assert header.index("global acc") < header.index("global bacc") < header.index("global auroc")
    # personal = global (nothing private): its accuracy column only, so a FedAvg table fits 80 columns
    assert "personal acc" in header and "personal bacc" not in header
    pooled = next(line for line in text.splitlines() if "pooled test set" in line)
    assert "0.7900" in pooled and "0.9123" in pooled
    notes = table_notes(summary_of(CLASSIFICATION, {"site0": 10, "site1": 0}))
    assert notes == ["warning: the global model predicts a single class",
                     "no test images (left out of the statistics): site1"]  # fmt: skip


def test_a_long_warning_under_the_table_stays_one_line_in_a_log_file():
    long = "the global model predicts a single class " + "and says so at length " * 8
    summary = {**summary_of(CLASSIFICATION, {"site0": 10, "site1": 5}), "collapse": {"messages": [long]}}
    out = io.StringIO()
    reporter = RoundReporter(enabled=True, console=Console(file=out, width=80, force_terminal=False))
    reporter.finish(summary, "runs/x")
    assert f"warning: {long}" in out.getvalue().splitlines()


def test_final_table_shows_the_extras_of_a_personal_model_that_differs():
    evaluation = {**CLASSIFICATION, "summary": {**CLASSIFICATION["summary"], "personal": {"acc": stats(0.9, 0.8),
        "balanced_acc": stats(0.85, 0.7), "auroc": stats(0.95, 0.9)}}}  # fmt: skip
    header = next(
        line
        for line in render(evaluation_table(summary_of(evaluation, {"site0": 10}))).splitlines()
        if "global acc" in line
    )
    assert header.index("personal acc") < header.index("personal bacc") < header.index("personal auroc")


def test_final_table_in_a_log_file_breaks_no_number():
    evaluation = {**CLASSIFICATION, "summary": {**CLASSIFICATION["summary"], "personal": {"acc": stats(0.9, 0.8),
        "balanced_acc": stats(0.85, 0.7), "auroc": stats(0.95, 0.9)}}}  # fmt: skip
    console, out = log_file_console()
    RoundReporter(console=console, bar=False).finish(summary_of(evaluation, {"site0": 10, "site1": 5}), "runs/x")
    rows = [line for line in out.getvalue().splitlines() if line.startswith("│ site0")]
    assert len(rows) == 1 and rows[0].count("0.8000") == 2 and "…" not in out.getvalue()
    assert console.width == 80  # widened for the table only


def test_final_table_of_segmentation_has_only_its_metric():
    summary = {
        "clients": {"site0": {"test_samples": 3, "global": {"dice": 0.5, "acc": 0.9}}},
        "summary": {"global": {"dice": stats(0.5, 0.5), "acc": stats(0.9, 0.9)}},
    }
    text = render(evaluation_table(summary, "dice"))
    assert "global dice" in text and "auroc" not in text and "bacc" not in text


def test_nan_cells_are_dashes():
    summary = {
        "clients": {"site0": {"test_samples": 3, "global": {"acc": 0.5, "auroc": math.nan}}},
        "summary": {"global": {"acc": stats(0.5, 0.5), "auroc": stats(0.5, 0.5)}},
    }
    row = next(line for line in render(evaluation_table(summary)).splitlines() if "site0" in line)
    assert "—" in row and "nan" not in row


def test_the_final_table_lists_only_the_worst_clients_beyond_fifty():
    from fl_lightning.outputs.report import TABLE_CLIENTS, evaluation_table, table_clients

    clients = {f"c{i:04d}": {"test_samples": 5, "global": {"acc": (i % 97) / 100}} for i in range(1000)}
    clients["c0500"] = {"test_samples": 0, "global": {}}  # no test images: listed last, if at all
    stat = {"mean": 0.5, "std": 0.1, "worst": 0.0}
    summary = {"clients": clients, "summary": {"global": {"acc": stat}}}
    shown = table_clients(summary, "global", "acc")
    assert len(shown) == TABLE_CLIENTS and "c0500" not in shown
    assert max(clients[c]["global"]["acc"] for c in shown) <= 0.05  # the worst ones (11 clients per hundredth)
    console = Console(file=io.StringIO(), width=200)
    console.print(evaluation_table(summary))
    text = console.file.getvalue()
    assert "… 950 more" in text and text.count("\n") < 80
    few = {"clients": dict(list(clients.items())[:3]), "summary": summary["summary"]}
    assert table_clients(few, "global", "acc") == ["c0000", "c0001", "c0002"]  # all of them, in their order


def test_the_round_line_and_the_final_table_show_epsilon_under_differential_privacy(tmp_path):
    """Issue 25: ε on the round line and under the final table (DP-FedAvg's, or DP-SGD's worst client)."""
    from callbacks import DPFedAvg

    fed = build_federation(
        tmp_path, callbacks=[DPFedAvg(noise_multiplier=1.0, clip_norm=1.0)], rounds=2, progress=False, quiet=False,
        aggregation="uniform", model_kwargs={"norm": "group"},
    )  # fmt: skip
    console, out = log_file_console()
    fed.reporter = RoundReporter.from_config(fed.config, console=console)
    summary = fed.run()
    lines = out.getvalue().splitlines()
    round_lines = [line for line in lines if line.startswith("round ")]
    rows = (fed.run_dir.path / "rounds.csv").read_text().splitlines()
    header = rows[0].split(",")
    eps = [float(r.split(",")[header.index("privacy/epsilon")]) for r in rows[1:]]
    assert [f"ε {e:.3g}" in line for line, e in zip(round_lines, eps)] == [True, True]
    final = next(line for line in lines if line.startswith("privacy: "))
    assert f"ε = {summary['privacy']['epsilon']:.3g} at δ = {summary['privacy']['delta']:.3g}" in final


def test_the_privacy_line_takes_the_worst_client_and_the_largest_delta():
    summary = {"privacy": {"epsilon_worst": 3.2, "delta": {"a": 1e-3, "b": 2e-3}, "mechanism": "DP-SGD"}}
    assert privacy_line(summary) == "privacy: ε = 3.2 (worst client) at δ = 0.002 — DP-SGD"
    assert privacy_line({"privacy": {"epsilon": math.inf, "delta": 0.01, "mechanism": "m"}}).startswith(
        "privacy: ε = ∞"
    )
    assert privacy_line({"summary": {}}) is None
    assert "ε" not in round_line(1, 2, {"a": {"train_loss": 1.0}}, {}, 0.1)
    assert round_line(1, 2, {"a": {"train_loss": 1.0}}, {}, 0.1, epsilon=7.98).endswith("ε 7.98  0.1s")


def test_an_epsilon_above_10_gets_a_warning_under_the_privacy_line():
    from fl_lightning.outputs.report import privacy_warning

    fedavg = {"privacy": {"epsilon": 3336.0, "delta": 0.02, "mechanism": "DP-FedAvg"}}
    warning = privacy_warning(fedavg)
    assert warning.startswith("warning: this run reaches ε = 3336 (δ = 0.02), above 10") and "dp-fedavg.md" in warning
    sgd = {"privacy": {"epsilon_worst": 12.5, "delta": {"a": 0.01, "b": 0.002}}}
    assert privacy_warning(sgd).startswith("warning: this run (its worst client) reaches ε = 12.5 (δ = 0.01)")
    for quiet in (
        {"privacy": {"epsilon": 7.98}},
        {"privacy": {"epsilon": math.inf}},
        {},
        {"privacy": {"epsilon": None}},
    ):
        assert privacy_warning(quiet) is None
