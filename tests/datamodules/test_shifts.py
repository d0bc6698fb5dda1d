"""Site styles: identity, inversion, purity, seeded noise, range and blur mean preservation."""

from __future__ import annotations

import pytest
import torch

from datamodules.shifts import SiteStyle, apply_style, default_site_styles


def _images(channels: int = 1) -> torch.Tensor:
    return torch.rand(6, channels, 12, 12, generator=torch.Generator().manual_seed(0))


def test_identity_style_returns_the_input_as_a_new_tensor() -> None:
    x = _images()
    out = apply_style(x, SiteStyle(), seed=0)
    assert torch.equal(out, x)
    assert out.data_ptr() != x.data_ptr()


def test_invert_is_one_minus_x() -> None:
    x = _images()
    torch.testing.assert_close(apply_style(x, SiteStyle(invert=True), seed=0), 1.0 - x)


def test_contrast_and_gamma_follow_their_formulas() -> None:
    x = _images()
    torch.testing.assert_close(apply_style(x, SiteStyle(contrast=0.5), seed=0), (x - 0.5) * 0.5 + 0.5)
    torch.testing.assert_close(apply_style(x, SiteStyle(gamma=2.0), seed=0), x**2)


def test_input_not_modified() -> None:
    x = _images()
    before = x.clone()
    apply_style(x, SiteStyle(contrast=0.3, gamma=1.5, blur_sigma=1.0, noise_std=0.2, invert=True), seed=1)
    assert torch.equal(x, before)


def test_deterministic_with_seed_and_noise_differs_across_seeds() -> None:
    x = _images()
    style = SiteStyle(noise_std=0.1, blur_sigma=0.8)
    a, b, c = apply_style(x, style, seed=5), apply_style(x, style, seed=5), apply_style(x, style, seed=6)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_noise_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    apply_style(_images(), SiteStyle(noise_std=0.1), seed=1)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("channels", [1, 3])
def test_all_default_styles_stay_in_unit_range(channels: int) -> None:
    x = _images(channels)
    for site, style in enumerate(default_site_styles(8, seed=0, channels=channels)):
        out = apply_style(x, style, seed=site)
        assert out.shape == x.shape
        assert out.min() >= 0.0 and out.max() <= 1.0


def test_blur_preserves_mean_and_smooths() -> None:
    x = _images()
    out = apply_style(x, SiteStyle(blur_sigma=1.5), seed=0)
    assert abs(out.mean().item() - x.mean().item()) < 0.01
    assert out.std() < 0.6 * x.std()


def test_tint_multiplies_channels_only_for_rgb() -> None:
    style = SiteStyle(tint=(1.0, 0.5, 0.25))
    rgb = _images(3)
    torch.testing.assert_close(apply_style(rgb, style, seed=0), rgb * torch.tensor([1.0, 0.5, 0.25]).view(1, 3, 1, 1))
    gray = _images(1)
    assert torch.equal(apply_style(gray, style, seed=0), gray)


def test_default_site_styles_fixed_first_five_and_seeded_rest() -> None:
    styles = default_site_styles(7, seed=0)
    assert styles[0] == SiteStyle()
    assert styles[1] == SiteStyle(gamma=1.8, contrast=0.5)
    assert styles[2] == SiteStyle(invert=True)
    assert styles[3] == SiteStyle(blur_sigma=1.0, gain=1.3)
    assert styles[4] == SiteStyle(noise_std=0.15, contrast=0.6)
    assert default_site_styles(7, seed=0) == styles
    assert default_site_styles(7, seed=1)[5:] != styles[5:]
    # A site's style does not depend on how many sites there are.
    assert default_site_styles(9, seed=0)[:7] == styles


def test_rgb_sites_get_distinct_tints_with_neutral_site0() -> None:
    styles = default_site_styles(8, seed=0, channels=3)
    assert styles[0].tint == (1.0, 1.0, 1.0)
    assert len({s.tint for s in styles}) == 8


def test_rejects_non_float_or_non_4d_input() -> None:
    with pytest.raises(ValueError, match="float"):
        apply_style(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), SiteStyle(), seed=0)
    with pytest.raises(ValueError, match="N, C, H, W"):
        apply_style(torch.zeros(1, 4, 4), SiteStyle(), seed=0)
