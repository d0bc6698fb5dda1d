"""FedER's privacy term and LPIPS distances against hand computations and the lpips package itself."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from callbacks.feder.perceptual import PerceptualDistance
from fl_lightning.ops.privacy import (
    discriminator_loss,
    generator_loss,
    lpips_pairwise,
    nearest_lpips,
    privacy_loss,
)


@pytest.fixture(scope="module")
def distance():
    return PerceptualDistance("alex", image_size=32)


def test_lpips_pairwise_by_hand():
    # one layer, 2 channels, 1x2 locations; weights (1, 3)
    a = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # (1, 2, 1, 2)
    b = torch.tensor([[[[0.0, 0.0]], [[1.0, 1.0]]], [[[1.0, 0.0]], [[0.0, 1.0]]]])  # (2, 2, 1, 2)
    w = torch.tensor([1.0, 3.0])
    # pair (a, b0): location 0: 1*(1-0)^2 + 3*(0-1)^2 = 4; location 1: 1*0 + 3*0 = 0; mean over 2 locations = 2
    # pair (a, b1): identical images -> 0
    d = lpips_pairwise([a], [b], [w])
    torch.testing.assert_close(d, torch.tensor([[2.0, 0.0]]))
    # a second layer adds its own spatial mean
    d2 = lpips_pairwise([a, a[:, :, :, :1]], [b, b[:, :, :, :1]], [w, w])
    torch.testing.assert_close(d2, torch.tensor([[2.0 + 4.0, 0.0]]))


def test_pairwise_matches_the_lpips_package_pair_by_pair(distance):
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, 1, 8, 8, generator=g), torch.rand(4, 1, 8, 8, generator=g)

    def prep(x):  # what PerceptualDistance documents: 3 channels, 32 px bilinear, [0, 1] inputs
        return F.interpolate(x.expand(-1, 3, -1, -1), size=32, mode="bilinear", align_corners=False)

    with torch.no_grad():
        expected = torch.tensor(
            [[float(distance.lpips(prep(a[i : i + 1]), prep(b[j : j + 1]), normalize=True)) for j in range(4)]
             for i in range(3)]
        )  # fmt: skip
        got = distance.pairwise(a, b)
        paired = distance(a, b[:3])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(paired, expected.diagonal(), rtol=1e-4, atol=1e-6)
    assert (got > 0).all()
    torch.testing.assert_close(distance.pairwise(a, a).diagonal(), torch.zeros(3), rtol=0, atol=1e-5)


def test_privacy_loss_sign_and_scale():
    d = torch.tensor([[0.2, 0.4], [0.6, 0.8]])
    assert privacy_loss(d).item() == pytest.approx(-0.5)  # minus the mean over all 4 pairs
    logits = torch.tensor([0.3, -1.2])
    nonsaturating = -(math.log(1 / (1 + math.exp(-0.3))) + math.log(1 / (1 + math.exp(1.2)))) / 2
    assert generator_loss(logits, d, 0.0).item() == pytest.approx(nonsaturating, rel=1e-6)
    assert generator_loss(logits, None, 0.0).item() == pytest.approx(nonsaturating, rel=1e-6)  # α = 0: plain GAN
    assert generator_loss(logits, d, 2.0).item() == pytest.approx(nonsaturating - 2 * 0.5, abs=1e-6)
    with pytest.raises(ValueError, match="distances"):
        generator_loss(logits, None, 1.0)


def test_minimising_the_privacy_term_moves_synthetic_images_away_from_real_ones(distance):
    g = torch.Generator().manual_seed(1)
    real = torch.rand(4, 1, 8, 8, generator=g)
    fake = (real + 0.05 * torch.randn(4, 1, 8, 8, generator=g)).clamp(0, 1).requires_grad_(True)
    before = distance.pairwise(fake, real)
    privacy_loss(before).backward()
    with torch.no_grad():
        after = distance.pairwise(fake - 0.5 * fake.grad, real)
    assert after.mean() > before.mean()


def test_discriminator_loss_by_hand():
    real, fake = torch.tensor([2.0]), torch.tensor([-1.0])
    expected = -math.log(1 / (1 + math.exp(-2.0))) - math.log(1 - 1 / (1 + math.exp(1.0)))
    assert discriminator_loss(real, fake).item() == pytest.approx(expected, rel=1e-6)


def test_nearest_is_the_argmin_of_the_full_matrix(distance):
    g = torch.Generator().manual_seed(2)
    queries, pool = torch.rand(5, 1, 8, 8, generator=g), torch.rand(11, 1, 8, 8, generator=g)
    pool[7] = queries[2]  # an exact copy is found at distance 0
    full = distance.pairwise(queries, pool).detach()
    d, idx = distance.nearest(queries, pool, batch=4)  # chunks of 4 cross the pool's end
    torch.testing.assert_close(d, full.min(dim=1).values)
    assert idx.tolist() == full.argmin(dim=1).tolist() and idx[2] == 7 and d[2] < 1e-5
    with pytest.raises(ValueError, match="non-empty"):
        nearest_lpips(distance.features(queries), distance.features(pool[:0]), distance.layer_weights)


def test_random_backbone_is_said_loudly_and_seeded(caplog, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))  # an empty hub cache
    with caplog.at_level(logging.WARNING):
        a = PerceptualDistance("alex")
    assert not a.pretrained_backbone and "RANDOM backbone" in caplog.text
    b = PerceptualDistance("alex")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_local_backbone_weights_are_loaded_from_a_path_or_the_hub_cache(tmp_path, monkeypatch, caplog):
    import torchvision

    torch.manual_seed(3)
    # torchvision's file also holds the classifier; only `features.*` is read, so the test saves just that (10 MB)
    state = {k: v for k, v in torchvision.models.alexnet(weights=None).state_dict().items() if k.startswith("features")}
    path = tmp_path / "alexnet.pth"
    torch.save(state, path)
    loaded = PerceptualDistance("alex", backbone_weights=str(path))
    assert loaded.pretrained_backbone
    torch.testing.assert_close(getattr(loaded.lpips.net.slice2, "3").weight, state["features.3.weight"])
    torch.testing.assert_close(getattr(loaded.lpips.net.slice5, "10").bias, state["features.10.bias"])

    from callbacks.feder.perceptual import hub_weights_path

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    hub_file = hub_weights_path("alex")
    hub_file.parent.mkdir(parents=True)
    torch.save(state, hub_file)
    with caplog.at_level(logging.WARNING):
        cached = PerceptualDistance("alex")
    assert cached.pretrained_backbone and "RANDOM" not in caplog.text
    torch.testing.assert_close(getattr(cached.lpips.net.slice1, "0").weight, state["features.0.weight"])


def test_bad_settings_name_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.pth"):
        PerceptualDistance("alex", backbone_weights=str(tmp_path / "nowhere.pth"))
    with pytest.raises(ValueError, match="image_size=16"):
        PerceptualDistance("alex", image_size=16)
    with pytest.raises(ValueError, match="net"):
        PerceptualDistance("resnet")
