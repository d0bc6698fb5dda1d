"""Today's results, frozen before the client/server boundary: every transport must reproduce them."""

import json
import math

import pytest

from tests.anchors.runs import ANCHOR_FILE, RUNS, run_and_describe

ANCHOR = json.loads(ANCHOR_FILE.read_text())
TRANSPORTS = ["inprocess", "serialized"]


def assert_matches(got: dict, want: dict, rel: float = 1e-5) -> None:
    assert set(got["states"]) == set(want["states"]), set(got["states"]) ^ set(want["states"])
    for key, (s, n) in want["states"].items():
        gs, gn = got["states"][key]
        assert math.isclose(gn, n, rel_tol=rel, abs_tol=1e-6), (key, gn, n)
        assert math.isclose(gs, s, rel_tol=rel, abs_tol=1e-5 * max(1.0, n)), (key, gs, s)
    # every anchored entry must be there (entries added to summary.json since, e.g. new metrics, are not compared)
    assert set(want["summary"]) <= set(got["summary"]), set(want["summary"]) - set(got["summary"])
    for key, v in want["summary"].items():
        g = got["summary"][key]
        assert (math.isnan(g) and math.isnan(v)) or math.isclose(g, v, rel_tol=rel, abs_tol=1e-7), (key, g, v)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", list(RUNS))
def test_final_states_and_summary_match_the_anchor(name, transport, tmp_path):
    got = run_and_describe(name, tmp_path, [f"--federation.transport={transport}"])
    assert_matches(got, ANCHOR[name])


def test_the_comparison_can_fail():
    want = ANCHOR["fedavg_digits"]
    key = next(iter(want["states"]))
    moved = {**want, "states": {**want["states"], key: [want["states"][key][0], want["states"][key][1] * (1 + 1e-4)]}}
    with pytest.raises(AssertionError):
        assert_matches(moved, want)
