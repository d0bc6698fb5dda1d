"""Figures stay O(N) to draw and readable with many clients: distributions and heat maps beyond a threshold."""

from __future__ import annotations

import numpy as np
import pytest

from fl_lightning.outputs import plots


def _close(fig) -> None:
    plots.pyplot().close(fig)


def _counts(n: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"site{i}": rng.integers(0, 20, size=k) for i in range(n)}


def _artists(fig) -> tuple[int, int, int, int]:
    """Patches, lines, images and collections over all axes of ``fig``."""
    axes = fig.axes
    return (
        sum(len(ax.patches) for ax in axes),
        sum(len(ax.lines) for ax in axes),
        sum(len(ax.images) for ax in axes),
        sum(len(ax.collections) for ax in axes),
    )


def test_few_clients_keep_one_stacked_bar_per_client():
    fig = plots.partition_figure(_counts(5, 10), _counts(5, 3), "samples")
    patches, _, images, _ = _artists(fig)
    _close(fig)
    assert patches == 5 * 10 + 5 * 3 and images == 0


def test_a_thousand_client_partition_draws_a_bounded_number_of_artists(tmp_path):
    n = 1000
    fig = plots.partition_figure(_counts(n, 10), _counts(n, 4, seed=1), "samples")
    patches, _, images, _ = _artists(fig)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    _close(fig)
    assert images == 2  # one heat map per panel (class, site)
    assert patches <= 2 * 30  # the size histograms; not n x classes bars (10,000 + 4,000 before)
    assert titles[0] == "training samples per client, by class"
    plots.plot_partition(_counts(n, 10), tmp_path / "partition.png", None, "pixels")
    assert (tmp_path / "partition.png").read_bytes()[:4] == b"\x89PNG"


def test_shares_are_row_normalised_and_empty_clients_stay_zero():
    out = plots.shares(np.array([[1.0, 3.0], [0.0, 0.0]]))
    assert out.tolist() == [[0.25, 0.75], [0.0, 0.0]]


def _rows(n: int, rounds: int, evaluated_every: int = 1) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for r in range(1, rounds + 1):
        for i in range(n):
            row = {"round": r, "client": f"site{i}"}
            if i % evaluated_every == 0 or r == rounds:  # sampled evaluation: the others' rows stay empty
                row["global/acc"] = float(rng.random())
            rows.append(row)
    return rows


@pytest.mark.parametrize(("n", "max_lines"), [(5, 6), (1000, 2)])
def test_curves_draw_one_line_per_client_only_for_few_clients(n, max_lines):
    fig = plots.curves_figure(_rows(n, 4, evaluated_every=3), "acc")
    _, lines, _, collections = _artists(fig)
    _close(fig)
    assert lines == max_lines  # few: a line per client and the mean; many: the mean and the worst client
    assert collections == (2 if n > plots.MANY_CLIENTS else 0)  # the 10-90 % and 25-75 % bands


def test_bands_hold_the_clients_evaluated_in_each_round():
    rounds, values = plots.by_round(plots.curve_series(_rows(9, 3, evaluated_every=3), "global", "acc"))
    assert rounds == [1, 2, 3] and [len(v) for v in values] == [3, 3, 9]
    assert plots.curves_figure([{"round": 1, "client": "a"}], "acc") is None


def test_heat_map_columns_group_clients_by_their_largest_class():
    share = np.array([[0.2, 0.8], [0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
    assert plots.dominant_order(share).tolist() == [1, 2, 0, 3]


def test_one_site_per_client_does_not_get_one_tick_label_per_site():
    n = 300
    sites = {f"site{i}": np.eye(1, n, i, dtype=int)[0] * 30 for i in range(n)}  # digits: client i is site i
    fig = plots.partition_figure(_counts(n, 10), sites, "samples")
    ticks = [len(ax.get_yticks()) for ax in fig.axes]
    _close(fig)
    assert max(ticks) <= 30
