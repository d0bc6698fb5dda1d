"""benchmarks/dp_sgd.py runs and reports every part of a DP step against the plain step."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dp_sgd  # noqa: E402


def test_the_benchmark_reports_each_part_and_leaves_no_hooks(capsys):
    dp_sgd.main(["--steps", "2", "--repeats", "1", "--width", "4", "--size", "8", "--threads", "1"])
    out = capsys.readouterr().out
    for part in ("forward+backward", "clip+noise", "update", "step"):
        assert f"DP-SGD {part}" in out
    assert out.count("x the plain step") == 4


def test_the_dp_loop_clips_and_noises():
    data = dp_sgd.batches(8, 8, 2)
    plain, dp = dp_sgd.model(4, 8), dp_sgd.model(4, 8)
    dp_sgd.plain_steps(plain, data, 0.05)
    dp_sgd.dp_steps(dp, data, 0.05, 8)
    assert not all(torch.equal(a, b) for a, b in zip(plain.parameters(), dp.parameters()))
    assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in dp.parameters())
