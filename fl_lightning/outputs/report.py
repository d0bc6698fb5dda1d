"""What the user sees in the terminal or a batch log: the run directory, one line per round, the final table.

The live Rich bar over rounds and clients is separate from that report: it is drawn only on a terminal (by
default), because a log file (SLURM, ``> log.txt``) would hold its frames, not a bar. The report itself is
printed as plain lines that Rich never wraps, so a round line stays one line in a log file.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from fl_lightning.ops.dp_meaning import is_large, large_epsilon_message
from fl_lightning.outputs.records import CLASS_BALANCE_METRICS


class _OutputSettings(Protocol):
    progress: bool | None
    quiet: bool


class RoundReporter:
    """The run directory, one line per round and the final table; a live progress bar on a terminal.

    Args:
        enabled: When false nothing is printed at all (``federation.quiet``, tests, sweeps).
        console: Where to print (default: a new Rich console on stdout).
        bar: The live bar over rounds and clients: True, False, or None for "only when ``console`` is a
            terminal" (so batch logs get the plain lines without bar frames).

    """

    def __init__(self, enabled: bool = True, console: Console | None = None, bar: bool | None = None) -> None:
        self._legend_shown = False
        self.enabled = enabled
        self.console = console or Console()
        self.bar = enabled and (self.console.is_terminal if bar is None else bar)
        self._progress: Progress | None = None

    @classmethod
    def from_config(cls, config: _OutputSettings, console: Console | None = None) -> RoundReporter:
        """The reporter for ``federation.progress`` (the bar) and ``federation.quiet`` (nothing at all)."""
        return cls(enabled=not config.quiet, console=console, bar=config.progress)

    def start(self, rounds: int, run_dir: str, first_round: int = 0) -> None:
        """Print the run directory and open the progress bars (on a terminal)."""
        if not self.enabled:
            return
        self._print(Text.assemble(("run directory:", "bold"), f" {run_dir}"))
        if not self.bar:
            return
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self._progress.start()
        self._rounds = self._progress.add_task("rounds", total=rounds, completed=first_round)
        self._clients = self._progress.add_task("clients", total=0)

    def round_start(self, num_clients: int) -> None:
        """Reset the client bar for a round with ``num_clients`` local fits."""
        if self._progress is not None:
            self._progress.reset(self._clients, total=num_clients)

    def client_done(self) -> None:
        """One local fit finished."""
        if self._progress is not None:
            self._progress.advance(self._clients)

    def round_end(self, line: str, legend: str | None = None) -> None:
        """Advance the round bar (if any) and print the round's one-line summary (above the bar).

        ``legend`` (what the line's numbers are) is printed once, above the first line that comes with one.
        """
        if self._progress is not None:
            self._progress.advance(self._rounds)
        if self.enabled:
            if legend is not None and not self._legend_shown:
                self._legend_shown = True
                self._print(legend)
            self._print(line)

    def note(self, line: str) -> None:
        """Print a message (e.g. where a resumed run continues from)."""
        if self.enabled:
            self._print(line)

    def stop(self) -> None:
        """Close the bars (also when the run fails)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def finish(self, summary: dict[str, Any], run_dir: str, metric: str = "acc") -> None:
        """Print the final evaluation table of ``metric`` and the run directory."""
        self.stop()
        if self.enabled:
            table = evaluation_table(summary, metric)
            # A log file has no width: print the table at its natural width instead of squeezing it into the 80
            # columns Rich assumes there (numbers folded, headers broken); a terminal keeps its own width.
            width = self.console.width
            if not self.console.is_terminal:
                self.console.width = max(width, natural_width(self.console, table))
            try:
                self.console.print(table)
            finally:
                self.console.width = width
            for note in table_notes(summary):  # one line each, unwrapped: grep finds a whole warning in a log
                self._print(Text(note, style="bold red"))
            chosen = selection_line(summary, metric)
            if chosen:
                self._print(chosen)
            privacy = privacy_line(summary)
            if privacy:
                self._print(privacy)
            warning = privacy_warning(summary)
            if warning:
                self._print(Text(warning, style="bold red"))
            self._print(Text.assemble(("run directory:", "bold"), f" {run_dir}"))

    def _print(self, line: str | Text) -> None:
        # soft_wrap: Rich would otherwise break lines at the console width, 80 columns when stdout is a file;
        # markup/highlight off: a client id or path with brackets must print as it is.
        self.console.print(line, soft_wrap=True, markup=False, highlight=False)


def selection_line(summary: dict[str, Any], metric: str = "acc") -> str | None:
    """Which round the table is of and how it was chosen, or None without a validation split.

    ``test of round 7 (best val/acc_mean 0.832; federation.select=best); last round 10: global acc 0.801``: the
    test sets were read once, for these rounds only.
    """
    selection = summary.get("selection")
    if not isinstance(selection, dict):
        return None
    chosen, value, monitor = selection.get("round"), selection.get("value"), selection.get("monitor")
    how = "best" if selection.get("select") == "best" else "last"
    value_text = "" if value is None else f" {value:.4g}"
    line = f"test of round {chosen} ({monitor}{value_text}, federation.select={how}; test read once)"
    last = summary.get("last_round")
    if isinstance(last, dict):
        stats = last.get("summary", {}).get("global") or last.get("summary", {}).get("personal") or {}
        mean = stats.get(metric, {}).get("mean")
        if mean is not None:
            line += f"; last round {last.get('round')}: {metric} mean {mean:.3f}"
    return line


def privacy_line(summary: dict[str, Any]) -> str | None:
    """``privacy: ε = 7.98 at δ = 0.002 (<mechanism>)`` under the final table, or None without a privacy entry.

    DP-SGD reports each client's (ε, δ): the line gives the worst client's ε and the largest δ.
    """
    privacy = summary.get("privacy")
    if not isinstance(privacy, dict) or ("epsilon" not in privacy and "epsilon_worst" not in privacy):
        return None
    epsilon = privacy.get("epsilon_worst", privacy.get("epsilon"))
    delta = privacy.get("delta")
    if isinstance(delta, dict):
        delta = max(delta.values(), default=None)
    eps_text = "∞" if epsilon is None or epsilon == float("inf") else f"{epsilon:.3g}"
    worst = " (worst client)" if "epsilon_worst" in privacy else ""
    delta_text = f" at δ = {delta:.3g}" if isinstance(delta, (int, float)) else ""
    return f"privacy: ε = {eps_text}{worst}{delta_text} — {privacy.get('mechanism', 'differential privacy')}"


def privacy_warning(summary: dict[str, Any]) -> str | None:
    """``warning: this run reaches ε = … above 10 …`` under the privacy line, or None while ε ≤ 10 (or absent)."""
    privacy = summary.get("privacy")
    if not isinstance(privacy, dict):
        return None
    eps = privacy.get("epsilon_worst", privacy.get("epsilon"))
    if not isinstance(eps, (int, float)) or not is_large(float(eps)):
        return None
    delta = privacy.get("delta")
    delta = max(delta.values(), default=None) if isinstance(delta, dict) else delta
    sgd = "epsilon_worst" in privacy
    what = "this run (its worst client)" if sgd else "this run"
    page = "docs/methods/dp-sgd.md" if sgd else "docs/methods/dp-fedavg.md"
    return "warning: " + large_epsilon_message(
        float(eps), delta, what, f"{page}, 'Choosing σ, C and the learning rate'"
    )


def natural_width(console: Console, table: Table) -> int:
    """The width ``table`` takes when nothing limits it (every header on one line)."""
    return Measurement.get(console, console.options.update_width(10_000), table).maximum


# Shown next to the primary metric where evaluated: class balance (classification), boundaries (segmentation).
EXTRA_METRICS = (*(name for name, _ in CLASS_BALANCE_METRICS), "hd95", "surface_dice")


def table_metrics(summary: dict[str, Any], metric: str = "acc") -> list[str]:
    """The final table's metric columns: ``metric``, then the :data:`EXTRA_METRICS` that were evaluated.

    Classification gets balanced accuracy and AUROC, segmentation HD95 and surface Dice.
    """
    evaluated = {name for stats in summary.get("summary", {}).values() for name in stats}
    return [metric] + [name for name in EXTRA_METRICS if name in evaluated and name != metric]


def evaluation_table(summary: dict[str, Any], metric: str = "acc") -> Table:
    """Per-client test metrics of each evaluated model, then mean, std and worst client, then the pooled test set.

    Beyond ``TABLE_CLIENTS`` clients only the worst ones (by ``metric`` of the first model) are listed, with a
    "… N more" row; mean, std and worst are always over every client.

    Classification shows balanced accuracy and AUROC next to ``metric`` (accuracy alone hides a model that
    predicts the majority class); the personal model gets them only where it differs from the global one, so
    a FedAvg table fits 80 columns. Clients without test images and signs of a collapsed or diverged run are
    printed under it (:func:`table_notes`).
    """
    stats = summary.get("summary", {})
    models = [m for m in ("global", "personal") if stats.get(m)]
    metrics = table_metrics(summary, metric)
    same = "global" in models and stats.get("personal") == stats.get("global")  # nothing private (FedAvg)
    columns = [(m, name) for m in models for name in (metrics if m == models[0] or not same else [metric])]
    shown = ", ".join(_LABELS.get(name, name) for name in metrics)
    table = Table(title=f"final test {shown} ({', '.join(models)} model{'s' * (len(models) > 1)})")
    table.add_column("client", no_wrap=True)
    table.add_column("samples", justify="right")
    for model, name in columns:
        # fold, not "…": a number cut short reads as another number
        table.add_column(f"{model} {_LABELS.get(name, name)}", justify="right", overflow="fold")
    clients = table_clients(summary, models[0] if models else "global", metric)
    for cid in clients:
        entry = summary["clients"][cid]
        table.add_row(cid, str(entry["test_samples"]), *[_fmt(entry.get(m, {}).get(name)) for m, name in columns])
    if len(clients) < len(summary["clients"]):
        table.add_row(f"… {len(summary['clients']) - len(clients)} more", "", *["" for _ in columns])
    table.add_section()
    for stat in ("mean", "std", "worst"):
        table.add_row(stat, "", *[_fmt(stats[m].get(name, {}).get(stat)) for m, name in columns])
    if "pooled" in summary:
        table.add_section()
        cells = [_fmt(summary["pooled"].get(name)) if m == "global" else "" for m, name in columns]
        table.add_row("pooled test set", str(summary["pooled_test_samples"]), *cells)
    return table


def table_notes(summary: dict[str, Any]) -> list[str]:
    """The lines under the final table: every collapse message (``warning: …``) and the clients without test images."""
    notes = [f"warning: {m}" for m in (summary.get("collapse") or {}).get("messages", [])]
    if summary.get("clients_without_test"):
        notes.append(f"no test images (left out of the statistics): {', '.join(summary['clients_without_test'])}")
    return notes


# Above this many clients the final table lists only the worst ones (every client is in summary.json and metrics.csv).
TABLE_CLIENTS = 50


def table_clients(summary: dict[str, Any], model: str, metric: str, limit: int = TABLE_CLIENTS) -> list[str]:
    """The clients the final table lists: all of them up to ``limit``, else the ``limit`` worst by ``metric``.

    With many clients (cross-device runs) a row per client would bury the statistics a reader looks for; the
    worst clients are the ones a fairness-minded reader checks. Clients without the metric come last.
    """
    ids = list(summary["clients"])
    if len(ids) <= limit:
        return ids

    def key(cid: str) -> tuple[bool, float]:
        value = summary["clients"][cid].get(model, {}).get(metric)
        missing = value is None or math.isnan(value)
        return missing, 0.0 if missing else value

    return sorted(ids, key=key)[:limit]


# Column names of the final table (the metric keys of summary.json are longer).
_LABELS = {"balanced_acc": "bacc", "auroc": "auroc", "surface_dice": "nsd"}  # as in the round line


def _fmt(value: float | None) -> str:
    """Four decimals, or a dash for a metric that is undefined (NaN, stored as null)."""
    return "—" if value is None or math.isnan(value) else f"{value:.4f}"
