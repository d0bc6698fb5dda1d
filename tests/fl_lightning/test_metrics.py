"""Classification metrics against scikit-learn, and the per-client summary against numpy by hand."""

import math
import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score, log_loss, roc_auc_score

from fl_lightning.clients.metrics import balanced_accuracy, classification_metrics, confusion_matrix, macro_f1
from fl_lightning.server.evaluation import summarise

# (seed, num_classes, num_samples, classes occurring in the targets, classes occurring in the predictions)
# None = all classes; label skew = targets missing classes, predictions of classes absent from the targets.
CASES = [
    (0, 10, 200, None, None),
    (1, 3, 7, None, None),
    (2, 10, 50, [0, 3, 7], None),  # label skew: most classes absent from the targets
    (3, 10, 50, [1, 2], [1, 2, 5, 9]),  # predictions of classes the client does not have
    (4, 5, 30, [4], [0, 1, 4]),  # a single class in the targets
    (5, 6, 25, [0, 1, 2], [3, 4, 5]),  # no prediction ever right
    (6, 10, 40, [2, 5], [2, 5]),  # num_classes larger than any class that occurs
    (7, 4, 1, None, None),  # one sample
]


def draw(seed, num_classes, n, target_classes, pred_classes):
    rng = np.random.default_rng(seed)
    t_pool = np.arange(num_classes) if target_classes is None else np.array(target_classes)
    p_pool = np.arange(num_classes) if pred_classes is None else np.array(pred_classes)
    target = rng.choice(t_pool, size=n)
    # Mostly correct where possible so recall/F1 are neither all 0 nor all 1.
    pred = np.where(np.isin(target, p_pool) & (rng.random(n) < 0.5), target, rng.choice(p_pool, size=n))
    return torch.from_numpy(pred), torch.from_numpy(target)


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_confusion_matrix_counts(case):
    pred, target = draw(*case)
    num_classes = case[1]
    cm = confusion_matrix(pred, target, num_classes)
    expected = np.zeros((num_classes, num_classes), dtype=np.int64)
    for t, p in zip(target.tolist(), pred.tolist()):
        expected[t, p] += 1
    np.testing.assert_array_equal(cm.numpy(), expected)


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_balanced_accuracy_matches_sklearn(case):
    pred, target = draw(*case)
    with warnings.catch_warnings():  # scikit-learn warns about the predicted classes absent from the targets
        warnings.simplefilter("ignore")
        expected = balanced_accuracy_score(target.numpy(), pred.numpy())
    assert balanced_accuracy(pred, target, case[1]) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_macro_f1_matches_sklearn(case):
    pred, target = draw(*case)
    expected = f1_score(target.numpy(), pred.numpy(), average="macro", zero_division=0)
    assert macro_f1(pred, target, case[1]) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_classification_metrics_match_sklearn(case, dtype):
    seed, num_classes, n, target_classes, pred_classes = case
    _, target = draw(*case)
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, num_classes, generator=gen, dtype=torch.float64)).to(dtype)
    if pred_classes is not None:  # push the argmax into the allowed prediction classes
        allowed = torch.zeros(num_classes, dtype=torch.bool)
        allowed[pred_classes] = True
        logits = logits.masked_fill(~allowed, -5.0)
    got = classification_metrics(logits, target, num_classes)
    assert set(got) == {"loss", "acc", "balanced_acc", "macro_f1", "auroc", "predicted_classes"}

    y, lg = target.numpy(), logits.double().numpy()
    pred = lg.argmax(1)
    prob = np.exp(lg - lg.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)
    nll = -np.log(prob[np.arange(n), y]).mean()  # cross-entropy by hand
    assert got["loss"] == pytest.approx(log_loss(y, prob, labels=np.arange(num_classes)), rel=1e-5)
    assert got["loss"] == pytest.approx(nll, rel=1e-5 if dtype == torch.float32 else 1e-10)
    assert got["acc"] == pytest.approx(accuracy_score(y, pred), abs=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected_bacc = balanced_accuracy_score(y, pred)
    assert got["balanced_acc"] == pytest.approx(expected_bacc, abs=1e-12)
    assert got["macro_f1"] == pytest.approx(f1_score(y, pred, average="macro", zero_division=0), abs=1e-12)
    assert got["predicted_classes"] == len(np.unique(pred))
    # AUROC: one-vs-rest per class that has positives and negatives, averaged (scikit-learn per class).
    per_class = [roc_auc_score(y == c, prob[:, c]) for c in range(num_classes) if 0 < (y == c).sum() < n]
    if per_class:
        assert got["auroc"] == pytest.approx(np.mean(per_class), abs=1e-5)
    else:
        assert np.isnan(got["auroc"])


def test_label_skew_is_not_averaged_over_absent_classes():
    # Two classes of ten occur, both always right: a fixed num_classes average would report 0.2.
    target = torch.tensor([3, 3, 7, 7, 7])
    assert balanced_accuracy(target, target, 10) == 1.0
    assert macro_f1(target, target, 10) == 1.0
    # One prediction of a class the client does not have: F1 counts that class (0), recall does not.
    pred = torch.tensor([3, 3, 7, 7, 1])
    assert balanced_accuracy(pred, target, 10) == pytest.approx((1 + 2 / 3) / 2)
    f1_7 = 2 * 2 / (3 + 2)
    assert macro_f1(pred, target, 10) == pytest.approx((1 + f1_7 + 0) / 3)


# ------------------------------------------------------------------------------------------------ summarise


def _by_hand(values):
    """Mean and population std with plain Python, not numpy's mean/std."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


@pytest.mark.parametrize("seed", range(4))
def test_summarise_mean_std_and_worst(seed):
    rng = np.random.default_rng(seed)
    ids = [f"site{i}" for i in range(int(rng.integers(1, 8)))]
    per_client = {
        cid: {"loss": float(rng.uniform(0.1, 3)), "acc": float(rng.uniform()), "macro_f1": float(rng.uniform())}
        for cid in ids
    }
    out = summarise(per_client)
    assert set(out) == {"loss", "acc", "macro_f1"}
    for name in ("loss", "acc", "macro_f1"):
        values = [per_client[c][name] for c in ids]
        mean, std = _by_hand(values)
        assert out[name]["mean"] == pytest.approx(mean, rel=1e-12)
        assert out[name]["std"] == pytest.approx(std, rel=1e-9, abs=1e-15)
        assert out[name]["std"] == pytest.approx(float(np.std(values, ddof=0)), rel=1e-9, abs=1e-15)
        worst = int(np.argmax(values)) if name == "loss" else int(np.argmin(values))
        assert out[name]["worst"] == values[worst]
        assert out[name]["worst_client"] == ids[worst]


def test_summarise_worst_direction_and_nan():
    per_client = {
        "a": {"loss": 0.5, "acc": 0.9},
        "b": {"loss": 2.0, "acc": float("nan")},  # NaN acc is skipped, its loss counts
        "c": {"loss": float("nan"), "acc": 0.4},
        "d": {"acc": 0.6},  # a client without a loss
    }
    out = summarise(per_client)
    assert out["loss"] == {"mean": 1.25, "std": 0.75, "worst": 2.0, "worst_client": "b"}
    acc = [0.9, 0.4, 0.6]
    mean, std = _by_hand(acc)
    assert out["acc"]["mean"] == pytest.approx(mean) and out["acc"]["std"] == pytest.approx(std)
    assert (out["acc"]["worst"], out["acc"]["worst_client"]) == (0.4, "c")
    # A metric that is NaN for every client is left out; no clients give an empty summary.
    assert "x" not in summarise({"a": {"x": float("nan"), "acc": 1.0}})
    assert summarise({}) == {}
    assert summarise({"a": {"acc": 0.3}})["acc"] == {"mean": 0.3, "std": 0.0, "worst": 0.3, "worst_client": "a"}


@pytest.mark.parametrize("seed", range(6))
def test_macro_auroc_from_ranks_equals_sklearn_with_ties_and_absent_classes(seed):
    """Tied scores (coarse probabilities), classes absent or alone in the target: scikit-learn to rounding."""
    from scipy.stats import rankdata

    from fl_lightning.clients.metrics import average_ranks, macro_auroc

    gen = torch.Generator().manual_seed(seed)
    n, k = 5 + 9 * seed, 2 + seed
    scores = torch.randint(0, 4, (n, k), generator=gen).double() / 4  # many ties
    target = torch.randint(0, max(1, k - 1), (n,), generator=gen)  # the last class never occurs
    assert np.array_equal(average_ranks(scores).numpy(), rankdata(scores.numpy(), axis=0))
    y = target.numpy()
    per_class = [roc_auc_score(y == c, scores[:, c].numpy()) for c in range(k) if 0 < (y == c).sum() < n]
    got = macro_auroc(scores, target)
    if per_class:
        assert got == pytest.approx(np.mean(per_class), abs=1e-12)
    else:
        assert np.isnan(got)
