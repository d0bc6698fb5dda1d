"""HD95 and surface Dice: equal to MONAI's functions, hand cases, empty masks, pooling; Dice against torchmetrics."""

import json
import math
import warnings

import pytest
import torch
from torch import nn

from fl_lightning.clients import SegmentationClient
from fl_lightning.clients.segmentation_metrics import pixel_confusion, segmentation_metrics
from fl_lightning.clients.surface_metrics import (
    distances_at,
    grouped_quantile,
    mask_edges,
    surface_metrics_from_sums,
    surface_metrics_per_image,
    surface_sums,
)
from fl_lightning.server.evaluation import summarise


@pytest.fixture(scope="module")
def monai_metrics():
    """MONAI's ``compute_hausdorff_distance`` and ``compute_surface_dice`` (the ``medical`` extra)."""
    metrics = pytest.importorskip("monai.metrics")
    return metrics.compute_hausdorff_distance, metrics.compute_surface_dice


def quiet(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` without MONAI's warnings (one per empty mask, and its own deprecations)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def onehot(masks: torch.Tensor, num_classes: int) -> torch.Tensor:
    return nn.functional.one_hot(masks, num_classes).permute(0, 3, 1, 2)


def blobs(batch: int, num_classes: int, size: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocky truth masks and predictions that are the truth shifted, with salt-and-pepper noise and empty images."""
    g = torch.Generator().manual_seed(seed)
    h, w = size
    coarse = torch.randint(0, num_classes, (batch, 1, h // 5 + 1, w // 5 + 1), generator=g).float()
    target = nn.functional.interpolate(coarse, size=(h, w)).long()[:, 0]
    noise = torch.rand(batch, h, w, generator=g) < 0.1
    preds = torch.where(noise, torch.randint(0, num_classes, (batch, h, w), generator=g), target.roll(2, 2))
    preds[0] = 0  # nothing predicted: every class present in the truth has one side empty
    target[1] = 0  # no foreground in the truth
    last = num_classes - 1
    preds[2][preds[2] == last], target[2][target[2] == last] = 0, 0  # the last class in neither
    return preds, target


@pytest.mark.parametrize(
    ("size", "tolerance", "percentile"), [((24, 24), 1.0, 95), ((17, 30), 2.0, 95), ((33, 12), 0.0, 100)]
)
def test_equal_to_monai_where_both_are_defined(monai_metrics, size, tolerance, percentile):
    hausdorff, surface_dice = monai_metrics
    num_classes = 5
    preds, target = blobs(12, num_classes, size, seed=sum(size))
    hd_monai = quiet(hausdorff, onehot(preds, num_classes), onehot(target, num_classes), percentile=percentile)
    nsd_monai = quiet(surface_dice, onehot(preds, num_classes), onehot(target, num_classes), [tolerance] * 4)
    hd_monai, nsd_monai = hd_monai.double(), nsd_monai.double()
    hd, nsd = surface_metrics_per_image(preds, target, num_classes, tolerance, percentile)
    present_p = torch.stack([(preds == c).flatten(1).any(1) for c in range(1, num_classes)], 1)
    present_t = torch.stack([(target == c).flatten(1).any(1) for c in range(1, num_classes)], 1)
    both = present_p & present_t
    assert both.sum() > 20 and (present_p ^ present_t).sum() > 4 and (~present_p & ~present_t).sum() > 0
    torch.testing.assert_close(hd[both], hd_monai[both], rtol=1e-5, atol=1e-4)
    defined = present_p | present_t
    torch.testing.assert_close(nsd[defined], nsd_monai[defined], rtol=1e-6, atol=1e-6)  # 0 where one is empty
    # the empty cases as defined here (MONAI: nan or inf for HD where one side is empty, nan where both are)
    assert (
        torch.isnan(hd[~defined]).all() and torch.isnan(nsd[~defined]).all() and torch.isnan(nsd_monai[~defined]).all()
    )
    assert (hd[present_p ^ present_t] == math.hypot(*size)).all()
    assert not torch.isfinite(hd_monai[present_p ^ present_t]).any()


def square(size: int, top: int, left: int, side: int) -> torch.Tensor:
    mask = torch.zeros(size, size, dtype=torch.long)
    mask[top : top + side, left : left + side] = 1
    return mask


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_square_shifted_by_k_pixels_has_hd95_k(monai_metrics, k):
    hausdorff, surface_dice = monai_metrics
    truth = square(24, 6, 5, 10)[None]
    shifted = square(24, 6, 5 + k, 10)[None]
    hd, nsd = surface_metrics_per_image(shifted, truth, 2, tolerance=k)
    assert float(hd) == pytest.approx(k)
    assert float(quiet(hausdorff, onehot(shifted, 2), onehot(truth, 2), percentile=95)) == pytest.approx(k)
    assert float(nsd) == 1.0  # every boundary pixel within k of the other boundary
    _, strict = surface_metrics_per_image(shifted, truth, 2, tolerance=k - 0.5)
    assert float(strict) == pytest.approx(float(quiet(surface_dice, onehot(shifted, 2), onehot(truth, 2), [k - 0.5])))
    assert 0 < float(strict) < 1  # the shifted sides are not within k − ½


def test_identical_masks_and_the_empty_cases():
    size = 16
    blob = square(size, 3, 4, 6)
    empty = torch.zeros(size, size, dtype=torch.long)
    preds = torch.stack([blob, empty, blob, empty])
    target = torch.stack([blob, empty, empty, blob])
    hd, nsd = surface_metrics_per_image(preds, target, 2)
    assert hd[0, 0] == 0 and nsd[0, 0] == 1  # identical
    assert hd[1, 0].isnan() and nsd[1, 0].isnan()  # both empty: undefined, left out
    diagonal = math.hypot(size, size)
    assert hd[2, 0] == diagonal and nsd[2, 0] == 0  # truth empty, something predicted
    assert hd[3, 0] == diagonal and nsd[3, 0] == 0  # structure missed
    metrics = surface_metrics_from_sums(**surface_sums(hd, nsd))
    assert metrics["hd95"] == pytest.approx(2 * diagonal / 3)  # over the three defined images
    assert metrics["surface_dice"] == pytest.approx(1 / 3)
    nothing = surface_metrics_from_sums(**surface_sums(hd[1:2], nsd[1:2]))
    assert math.isnan(nothing["hd95"]) and math.isnan(nothing["surface_dice"])


def test_per_class_means_then_the_mean_over_classes():
    # class 1 defined on two images (HD 1 and 3), class 2 on one (HD 10): (2 + 10) / 2, not (1 + 3 + 10) / 3
    hd = torch.tensor([[1.0, math.nan], [3.0, 10.0]], dtype=torch.float64)
    nsd = torch.tensor([[1.0, math.nan], [0.5, 0.0]], dtype=torch.float64)
    metrics = surface_metrics_from_sums(**surface_sums(hd, nsd))
    assert metrics == {"hd95": pytest.approx(6.0), "surface_dice": pytest.approx(0.375)}


def test_distances_and_quantiles_against_brute_force():
    g = torch.Generator().manual_seed(1)
    for h, w in [(9, 14), (14, 9)]:
        sites = torch.rand(5, h, w, generator=g) < 0.08
        sites[2] = False  # an image without sites
        queries = torch.rand(5, h, w, generator=g) < 0.3
        image, dist = distances_at(sites, queries)
        coords = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).float()
        for n in range(5):
            want = torch.cdist(coords[queries[n]], coords[sites[n]]).amin(1) if sites[n].any() else None
            got = dist[image == n].sort().values  # within an image the queries come in no particular order
            if want is None:
                assert torch.isinf(got).all() and got.numel() == queries[n].sum()
            else:
                torch.testing.assert_close(got, want.sort().values)
    groups = torch.tensor([0, 0, 0, 2, 2, 0, 2, 3])
    values = torch.tensor([5.0, 1.0, 3.0, 2.0, 8.0, 4.0, 1.0, 7.0])
    got = grouped_quantile(groups, values, 4, 0.95)
    for gid in (0, 2, 3):
        assert float(got[gid]) == pytest.approx(float(torch.quantile(values[groups == gid], 0.95)))
    assert got[1].isnan()


def test_edges_are_the_mask_minus_its_erosion():
    from scipy.ndimage import binary_erosion  # MONAI's edges: scipy's erosion (cross structure, border outside)

    masks = torch.rand(6, 11, 9, generator=torch.Generator().manual_seed(2)) < 0.6
    want = torch.stack([torch.from_numpy(m ^ binary_erosion(m)) for m in masks.numpy()])
    assert torch.equal(mask_edges(masks), want)
    full = mask_edges(torch.ones(1, 8, 8, dtype=torch.bool))[0]
    assert full.sum() == 4 * 8 - 4  # the image border counts as outside: the whole image has its rim as boundary


class FixedLogits(nn.Module):
    """One-hot logits of the stored prediction of image i (its index is the input's first pixel)."""

    def __init__(self, preds: torch.Tensor, num_classes: int) -> None:
        super().__init__()
        self.register_buffer("logits", 5.0 * nn.functional.one_hot(preds, num_classes).permute(0, 3, 1, 2).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits[x[:, 0, 0, 0].long()]


def test_pooled_from_parts_equals_the_concatenated_test_sets():
    num_classes, size = 4, (20, 20)
    preds, target = blobs(30, num_classes, size, seed=3)
    client = SegmentationClient(num_classes=num_classes, image_size=size, depth=1, width=2)
    client.net = FixedLogits(preds, num_classes)
    index = torch.arange(30.0).view(30, 1, 1, 1).expand(30, 1, *size)
    cpu = torch.device("cpu")
    shards = [slice(0, 4), slice(4, 17), slice(17, 30)]  # three clients' test sets
    parts = [client.evaluation_parts([(index[s], target[s])], cpu) for s in shards]
    pooled = client.metrics_from_parts(client.merge_parts(parts))
    batches = [(index[i : i + 7], target[i : i + 7]) for i in range(0, 30, 7)]  # another batching
    whole = client.evaluate(batches, cpu)
    assert {"hd95", "surface_dice"} <= whole.keys()
    for key in ("hd95", "surface_dice", "dice"):
        assert pooled[key] == pytest.approx(whole[key], rel=1e-9)
    # by hand: per class the mean over images with a value, then the mean over classes
    hd, nsd = surface_metrics_per_image(preds, target, num_classes)
    by_hand_hd = torch.stack([hd[:, c][~hd[:, c].isnan()].mean() for c in range(num_classes - 1)]).mean()
    by_hand_nsd = torch.stack([nsd[:, c][~nsd[:, c].isnan()].mean() for c in range(num_classes - 1)]).mean()
    assert whole["hd95"] == pytest.approx(float(by_hand_hd))
    assert whole["surface_dice"] == pytest.approx(float(by_hand_nsd))
    # a client's own value is its images' mean, not the pooled one
    first = client.metrics_from_parts(parts[0])
    assert first["hd95"] == pytest.approx(client.evaluate([(index[:4], target[:4])], cpu)["hd95"])


def test_the_worst_client_of_hd95_is_the_largest():
    stats = summarise({"a": {"hd95": 2.0, "dice": 0.9}, "b": {"hd95": 7.0, "dice": 0.5}})
    assert stats["hd95"]["worst"] == 7.0 and stats["hd95"]["worst_client"] == "b"
    assert stats["dice"]["worst_client"] == "b"


def test_surface_tolerance_is_validated():
    with pytest.raises(ValueError, match="surface_tolerance"):
        SegmentationClient(surface_tolerance=-1.0)


def test_dice_equals_torchmetrics_dice_score_with_global_aggregation_not_its_default():
    """Why Dice stays hand-written (the decision, pinned).

    torchmetrics' ``DiceScore(include_background=False, average="macro", aggregation_level="global")`` gives our
    ``dice`` (per class 2·TP / (2·TP + FP + FN) over all pixels of the test set, classes absent from targets and
    predictions left out, mean over the foreground classes), and ``include_background=True`` our
    ``dice_with_background``. Its default ``aggregation_level="samplewise"`` is another metric (the mean over images
    of per-image Dice). Ours stays: it is read off the pixel confusion matrix the evaluation keeps for accuracy
    anyway, a (C, C) int64 count whose sum over clients is exactly the pooled test set's, whereas DiceScore keeps
    per-image lists (states grow with the test set) and two instances would be needed.
    """
    from torchmetrics.segmentation import DiceScore

    num_classes = 5
    g = torch.Generator().manual_seed(0)
    preds = torch.randint(0, num_classes - 1, (6, 12, 12), generator=g)  # class 4 never predicted ...
    target = torch.randint(0, num_classes - 1, (6, 12, 12), generator=g)  # ... nor present: left out
    preds[0] = 0  # an image without foreground predictions

    def score(**kwargs) -> float:
        metric = DiceScore(num_classes, average="macro", input_format="index", **kwargs)
        for i in range(0, 6, 4):  # two updates, as batches
            metric.update(preds[i : i + 4], target[i : i + 4])
        return float(metric.compute())

    ours = segmentation_metrics(pixel_confusion(preds, target, num_classes))
    assert ours["dice"] == pytest.approx(score(include_background=False, aggregation_level="global"), abs=1e-6)
    assert ours["dice_with_background"] == pytest.approx(
        score(include_background=True, aggregation_level="global"), abs=1e-6
    )
    samplewise = score(include_background=False)
    assert abs(samplewise - ours["dice"]) > 1e-3  # the default averages per image: not our metric


def test_a_segmentation_run_reports_hd95_and_surface_dice(tmp_path):
    from fl_lightning.cli import main

    main(["--config", "configs/fedavg_digits_seg.yaml", "--data.image_size=16", "--model.width=4",
          "--trainer.logger=false", "--federation.rounds=1", "--federation.progress=false",
          "--federation.plots=false", "--data.max_samples_per_client=20", f"--federation.output_dir={tmp_path}",
          "--federation.run_name=r"])  # fmt: skip
    run = tmp_path / "r"
    summary = json.loads((run / "summary.json").read_text())
    for key in ("hd95", "surface_dice"):
        assert math.isfinite(summary["pooled"][key])
        assert key in summary["summary"]["global"]
        assert all(key in entry["global"] for entry in summary["clients"].values())
    hd = summary["summary"]["global"]["hd95"]
    assert hd["worst"] == max(entry["global"]["hd95"] for entry in summary["clients"].values())
    assert 0 <= summary["pooled"]["surface_dice"] <= 1
    rounds_header = (run / "rounds.csv").read_text().splitlines()[0].split(",")
    assert {"eval/global/hd95", "eval/global/surface_dice", "eval/pooled/hd95"} <= set(rounds_header)
    assert {"global/hd95", "global/surface_dice"} <= set((run / "metrics.csv").read_text().splitlines()[0].split(","))
