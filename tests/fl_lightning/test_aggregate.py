"""The weighted average against a hand computation, and its edge cases."""

import pytest
import torch

from fl_lightning.ops import RunningWeightedMean, aggregation_weights, weighted_average


def test_weighted_average_matches_hand_computation():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor(-1.0)}
    p = aggregation_weights([10, 30])
    assert p == pytest.approx([0.25, 0.75])
    out = weighted_average([a, b], p)
    torch.testing.assert_close(out["w"], torch.tensor([0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 6]))
    torch.testing.assert_close(out["b"], torch.tensor(0.25 * 3 - 0.75 * 1))


def test_uniform_weights_ignore_sample_counts():
    assert aggregation_weights([1, 99, 900], "uniform") == pytest.approx([1 / 3] * 3)


def test_single_client_average_is_exact():
    w = {"w": torch.randn(50, dtype=torch.float32)}
    assert torch.equal(weighted_average([w], aggregation_weights([7]))["w"], w["w"])


def test_integer_buffers_stay_integers():
    out = weighted_average([{"n": torch.tensor(10)}, {"n": torch.tensor(13)}], [0.5, 0.5])
    assert out["n"].dtype == torch.int64 and out["n"].item() == 12  # 11.5 rounds half to even


def test_streaming_mean_equals_batch_mean():
    states = [{"w": torch.randn(4, 3)} for _ in range(5)]
    weights = aggregation_weights([3, 1, 4, 1, 5])
    mean = RunningWeightedMean()
    for s, w in zip(states, weights):
        mean.add(s, w)
    expected = sum(w * s["w"] for s, w in zip(states, weights))
    torch.testing.assert_close(mean.result()["w"], expected)


@pytest.mark.parametrize(
    ("counts", "scheme", "message"),
    [([], "samples", "empty"), ([0, 0], "samples", "zero samples"), ([1], "median", "samples' or 'uniform")],
)
def test_bad_weights_raise(counts, scheme, message):
    with pytest.raises(ValueError, match=message):
        aggregation_weights(counts, scheme)


def test_mismatched_keys_name_the_key():
    mean = RunningWeightedMean()
    mean.add({"a": torch.zeros(1)}, 1.0)
    with pytest.raises(KeyError, match="'b'"):
        mean.add({"b": torch.zeros(1)}, 1.0)
