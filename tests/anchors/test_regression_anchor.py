"""Today's results, frozen before the client/server boundary: every transport must reproduce them.

The anchor was stored on another machine, whose CPU kernels (AVX-512, AVX2, ARM, the generic ones) round in other
orders; a few SGD steps carry those last-bit differences into the weights. Measured on one machine under
``ATEN_CPU_CAPABILITY`` default, avx2 and avx512 against the anchor: six runs' per-tensor norms and sums within
2.6e-7 of the norm; scfl_digits_seg within 1.2e-3 of max(1, norm) (its sample clustering, two Gaussian
components per class fit by EM, turns the last bits into a slightly different split; with one component per class
it stays within 1.6e-4).
The summary's metrics that count samples or pixels (acc, dice, miou on 4 test images) then move by a pixel or
two: up to 0.01 absolute, auroc by 9e-4. The tolerances below stay well above what the kernels changed.
"""

import json
import math

import pytest

from tests.anchors.runs import ANCHOR_FILE, RUNS, run_and_describe

ANCHOR = json.loads(ANCHOR_FILE.read_text())
TRANSPORTS = ["inprocess", "serialized"]


# Per-tensor norms and sums must agree within this fraction of max(1, norm) (400x the measured).
STATE_TOLERANCE = 1e-4
RUN_STATE_TOLERANCE = {"scfl_digits_seg": 1e-2}  # the clustering's split moves with the last bits (8x the measured)
METRIC_TOLERANCE = 0.02  # absolute, on summary entries: a pixel or two of a tiny test set (relative 1e-3 on top)


def assert_matches(got: dict, want: dict, rel: float = STATE_TOLERANCE) -> None:
    assert set(got["states"]) == set(want["states"]), set(got["states"]) ^ set(want["states"])
    for key, (s, n) in want["states"].items():
        gs, gn = got["states"][key]
        assert math.isclose(gn, n, rel_tol=rel, abs_tol=rel), (key, gn, n)
        assert math.isclose(gs, s, rel_tol=rel, abs_tol=rel * max(1.0, n)), (key, gs, s)
    # every anchored entry must be there (entries added to summary.json since, e.g. new metrics, are not compared)
    assert set(want["summary"]) <= set(got["summary"]), set(want["summary"]) - set(got["summary"])
    for key, v in want["summary"].items():
        g = got["summary"][key]
        close = math.isclose(g, v, rel_tol=rel, abs_tol=METRIC_TOLERANCE)
        assert (math.isnan(g) and math.isnan(v)) or close, (key, g, v)


@pytest.mark.kernels
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", list(RUNS))
def test_final_states_and_summary_match_the_anchor(name, transport, tmp_path):
    got = run_and_describe(name, tmp_path, [f"--federation.transport={transport}"])
    assert_matches(got, ANCHOR[name], RUN_STATE_TOLERANCE.get(name, STATE_TOLERANCE))


def test_the_comparison_can_fail():
    want = ANCHOR["fedavg_digits"]
    key = next(iter(want["states"]))
    moved = {**want, "states": {**want["states"], key: [want["states"][key][0], want["states"][key][1] * (1 + 1e-2)]}}
    with pytest.raises(AssertionError):
        assert_matches(moved, want)
    metric = next(k for k in want["summary"] if k.endswith("acc/mean"))
    moved = {**want, "summary": {**want["summary"], metric: want["summary"][metric] + 0.05}}
    with pytest.raises(AssertionError):
        assert_matches(moved, want)
