"""benchmarks/secagg.py runs, prints a row per client count, and its masked sum is the plain one."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import secagg as secagg_bench  # noqa: E402


def test_the_benchmark_prints_a_row_per_client_count_and_the_masked_sum_is_within_the_bound(capsys):
    rows = secagg_bench.main(
        ["--clients", "2", "5", "7", "--repeats", "1", "--verify-up-to", "5", "--width", "4", "--size", "8",
         "--threads", "1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert [r["m"] for r in rows] == [2, 5, 7]
    assert all(f"| {m} |" in out for m in (2, 5, 7)) and "not built" in out  # 7 > --verify-up-to: timed only
    for r in rows[:2]:  # the decoded masked sum against the exact Σ p_i Δ_i; 1e-9 relative: float64's own rounding
        assert 0 < r["error"] <= r["bound"] * (1 + 1e-9)
    assert math.isnan(rows[2]["error"])
    for r in rows:
        assert r["client_s"] > r["keys_s"] > 0 and r["server_s"] > 0 and r["plain_s"] > 0
        # int64 words instead of float32 entries: the masked reply is about twice the plain one
        assert 1.8 * r["up_plain"] < r["up_masked"] < 2.2 * r["up_plain"]
    assert rows[2]["down_extra"] > rows[0]["down_extra"]  # the round's public keys: O(m) in every task
