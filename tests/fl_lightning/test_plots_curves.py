"""curves.png: integer round ticks, and no personal panel that repeats the global one."""

from __future__ import annotations

import re

import pytest

from fl_lightning.outputs import plots


def _rows(rounds: int, clients: int = 3, personal: str = "same") -> list[dict]:
    """Rows like ``metrics.csv``'s; personal = global (FedAvg), differs, or is absent."""
    rows = []
    for r in range(1, rounds + 1):
        for i in range(clients):
            row = {"round": r, "client": f"site{i}", "global/acc": 0.1 * r + 0.01 * i}
            if personal == "same":
                row["personal/acc"] = row["global/acc"]
            elif personal == "differs":
                row["personal/acc"] = row["global/acc"] + (0.05 if i == 1 else 0.0)
            rows.append(row)
    return rows


def _visible_tick_labels(ax) -> list[str]:
    """The x tick labels drawn: inside the view (the locator also returns ticks just beyond it)."""
    low, high = sorted(ax.get_xlim())
    return [t.get_text() for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]


def _panels(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes]


@pytest.mark.parametrize("rounds", [1, 3, 7, 40])
def test_round_ticks_are_integers(rounds):
    fig = plots.curves_figure(_rows(rounds, personal="differs"), "acc")
    fig.canvas.draw()
    labels = [label for ax in fig.axes for label in _visible_tick_labels(ax)]
    plots.pyplot().close(fig)
    assert labels and all(re.fullmatch(r"\d+", label) for label in labels), labels
    if rounds == 1:
        assert labels == ["1", "1"]  # one tick per panel, at the round


def test_one_panel_when_every_personal_metric_is_the_global_one():
    rows = _rows(3, personal="same")
    assert plots.personal_repeats_global(rows, "acc")
    fig = plots.curves_figure(rows, "acc")
    titles = _panels(fig)
    plots.pyplot().close(fig)
    assert titles == ["global model (= personal): test acc per client"]


def test_two_panels_when_a_personal_metric_differs_in_any_round():
    rows = _rows(3, personal="same")
    rows[-1]["personal/acc"] += 1e-9  # one client in the last round
    assert not plots.personal_repeats_global(rows, "acc")
    fig = plots.curves_figure(rows, "acc")
    titles = _panels(fig)
    plots.pyplot().close(fig)
    assert titles == ["global model: test acc per client", "personal model: test acc per client"]


def test_values_read_back_from_the_csv_compare_as_numbers():
    rows = [{k: str(v) for k, v in row.items()} for row in _rows(2, personal="same")]  # a resumed run's rows
    assert plots.personal_repeats_global(rows, "acc")
    assert not plots.personal_repeats_global(_rows(2, personal="none"), "acc")  # no personal rows at all
    only_personal = [{"round": 1, "client": "a", "personal/acc": 0.5}]
    assert not plots.personal_repeats_global(only_personal, "acc")
    fig = plots.curves_figure(only_personal, "acc")
    assert _panels(fig) == ["personal model: test acc per client"]
    plots.pyplot().close(fig)
