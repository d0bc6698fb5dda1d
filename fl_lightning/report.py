"""What the user sees in the terminal: a Rich progress bar over rounds and clients, and the final table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class RoundReporter:
    """Progress over rounds and clients plus one line per round.

    Args:
        enabled: When false nothing is printed (tests, sweeps).
        console: Where to print (default: a new Rich console on stdout).

    """

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console()
        self._progress: Progress | None = None

    def start(self, rounds: int, run_dir: str, first_round: int = 0) -> None:
        """Print the run directory and open the progress bars."""
        if not self.enabled:
            return
        self.console.print(f"[bold]run directory:[/bold] {run_dir}")
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

    def round_end(self, line: str) -> None:
        """Advance the round bar and print the round's one-line summary above it."""
        if self._progress is not None:
            self._progress.advance(self._rounds)
            self._progress.console.print(line)

    def note(self, line: str) -> None:
        """Print a message (e.g. where a resumed run continues from)."""
        if self.enabled:
            self.console.print(line)

    def stop(self) -> None:
        """Close the bars (also when the run fails)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def finish(self, summary: dict[str, Any], run_dir: str, metric: str = "acc") -> None:
        """Print the final evaluation table of ``metric`` and the run directory."""
        self.stop()
        if self.enabled:
            self.console.print(evaluation_table(summary, metric))
            self.console.print(f"[bold]run directory:[/bold] {run_dir}")


def evaluation_table(summary: dict[str, Any], metric: str = "acc") -> Table:
    """Per-client test ``metric`` of each evaluated model, then mean, std and worst client."""
    models = [m for m in ("global", "personal") if summary.get("summary", {}).get(m)]
    table = Table(title=f"final test {metric} ({', '.join(models)} model{'s' if len(models) > 1 else ''})")
    table.add_column("client")
    table.add_column("test samples", justify="right")
    for model in models:
        table.add_column(f"{model} {metric}", justify="right")
    for cid, entry in summary["clients"].items():
        cells = [_fmt(entry.get(m, {}).get(metric)) for m in models]
        table.add_row(cid, str(entry["test_samples"]), *cells)
    table.add_section()
    for stat in ("mean", "std", "worst"):
        cells = [_fmt(summary["summary"][m].get(metric, {}).get(stat)) for m in models]
        table.add_row(stat, "", *cells)
    if "pooled" in summary:
        table.add_section()
        cells = [_fmt(summary["pooled"].get(metric)) if m == "global" else "" for m in models]
        table.add_row("pooled test set", str(summary["pooled_test_samples"]), *cells)
    return table


def _fmt(value: float | None) -> str:
    """Four decimals, or a dash for a metric that is undefined (stored as null)."""
    return "—" if value is None else f"{value:.4f}"
