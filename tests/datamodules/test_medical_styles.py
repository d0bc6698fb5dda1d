"""Modality-true site styles: MRI bias field, Rician noise, Gibbs ringing, k-space spikes and H&E stain variation.

Each style is checked for being seeded per site and pure, against an independent reference (a formula computed
here, or MONAI's own transform where MONAI is installed), for keeping [0, 1], and inside a datamodule.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from datamodules import DigitsFederated, MedMNISTFederated
from datamodules.sampler import stable_seed
from datamodules.shifts import (
    HED_FROM_RGB,
    NAMED_STYLES,
    RGB_FROM_HED,
    SiteStyle,
    apply_style,
    hed_to_rgb,
    log_bias_field,
    parse_style,
    resolve_site_styles,
    rgb_to_hed,
    site_draws,
    style_name,
)

NEW_STYLES = ("bias_field", "rician_noise", "gibbs", "kspace_spikes", "stain_he")
# The styles whose parameters are drawn per site (Gibbs ringing has none; Rician noise draws per image).
DRAWN = {"bias_field": "bias_coefficients", "kspace_spikes": "spike", "stain_he": "stain_scale"}


def site_seed(site: int, seed: int = 0) -> int:
    """The seed a datamodule gives ``apply_style`` for client ``site{site}`` and its style (build_client_splits)."""
    return stable_seed(seed, "style", f"site{site}", site)


def images(channels: int = 1, n: int = 4, size: int = 12, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    x = torch.rand(n, channels, size, size, generator=torch.Generator().manual_seed(0))
    return low + (high - low) * x


def channels_for(name: str) -> int:
    return 3 if name == "stain_he" else 1


# ------------------------------------------------------------------------------------------ all five styles


@pytest.mark.parametrize("name", NEW_STYLES)
def test_seeded_pure_and_in_range(name):
    x = images(channels_for(name))
    before = x.clone()
    style = parse_style(name)
    a, b = apply_style(x, style, seed=site_seed(1)), apply_style(x, style, seed=site_seed(1))
    assert torch.equal(x, before), "input modified"
    assert torch.equal(a, b), "same seed, different output"
    assert a.shape == x.shape and a.dtype == x.dtype
    assert a.min() >= 0.0 and a.max() <= 1.0
    assert not torch.equal(a, x), "the style did nothing"


@pytest.mark.parametrize("name", NEW_STYLES)
def test_different_sites_get_different_parameters(name):
    x = images(channels_for(name))
    style = parse_style(name)
    one, two = apply_style(x, style, seed=site_seed(1)), apply_style(x, style, seed=site_seed(2))
    if name == "gibbs":  # nothing is drawn: every site rings alike
        assert torch.equal(one, two)
        assert site_draws(style, site_seed(1), 12, 12) == site_draws(style, site_seed(2), 12, 12)
        return
    assert not torch.equal(one, two)
    if name in DRAWN:
        draws = [getattr(site_draws(style, site_seed(s), 12, 12), DRAWN[name]) for s in range(6)]
        assert all(d is not None for d in draws)
        assert len(set(draws)) == 6, "two sites drew the same parameters"
        # The same site draws the same parameters whatever the image batch.
        assert site_draws(style, site_seed(3), 12, 12) == site_draws(style, site_seed(3), 12, 12)


@pytest.mark.parametrize("name", NEW_STYLES)
def test_the_global_rng_is_untouched(name):
    torch.manual_seed(0)
    np.random.seed(0)
    expected = torch.rand(3), np.random.rand(3)
    torch.manual_seed(0)
    np.random.seed(0)
    apply_style(images(channels_for(name)), parse_style(name), seed=5)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])


@pytest.mark.parametrize("name", NEW_STYLES)
def test_zero_is_the_identity_and_empty_batches_pass(name):
    x = images(channels_for(name))
    assert torch.equal(apply_style(x, SiteStyle(**{name: 0.0}), seed=1), x)
    empty = torch.zeros(0, channels_for(name), 8, 8)
    assert apply_style(empty, parse_style(name), seed=1).shape == empty.shape


def test_import_datamodules_does_not_import_monai():
    code = "import sys, datamodules; assert 'monai' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------ the specs


def test_each_name_sets_its_parameter_and_the_grammar_takes_them():
    for name in NEW_STYLES:
        assert set(NAMED_STYLES[name]) == {name}
        assert parse_style(name) == SiteStyle(**NAMED_STYLES[name])
    assert parse_style({"bias_field": 0.5}) == SiteStyle(bias_field=0.5)
    assert parse_style("bias_field=0.5+rician_noise=0.1") == SiteStyle(bias_field=0.5, rician_noise=0.1)
    assert parse_style("low_contrast+gibbs") == SiteStyle(contrast=0.5, gibbs=0.7)
    assert parse_style("kspace_spikes+kspace_spikes=0.3") == SiteStyle(kspace_spikes=0.3)
    assert parse_style(SiteStyle(stain_he=0.1)) == SiteStyle(stain_he=0.1)
    assert style_name([SiteStyle(bias_field=0.3)], 0) == "bias_field=0.3"
    assert style_name([{"stain_he": 0.2}], 0) == "stain_he=0.2"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("gibbs=1.5", "gibbs=1.5"),
        ({"gibbs": -0.1}, "gibbs=-0.1"),
        ("stain_he=1", "stain_he=1.0"),
        ("bias_field=-0.2", "bias_field=-0.2"),
        ("rician_noise=-1", "rician_noise=-1.0"),
        ("kspace_spikes=-0.1", "kspace_spikes=-0.1"),
        ("bias_field=strong", "cannot read bias_field='strong'"),
        ("bias_fields", "unknown style 'bias_fields'.*bias_field"),
    ],
)
def test_bad_values_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_style(spec)


# ------------------------------------------------------------------------------------------ bias field


def legendre(k: int, t: np.ndarray) -> np.ndarray:
    return [np.ones_like(t), t, (3 * t**2 - 1) / 2, (5 * t**3 - 3 * t) / 2][k]


def test_bias_field_is_the_image_times_exp_of_the_drawn_polynomial():
    x = images(n=2, size=6, low=0.1, high=0.5)
    style = SiteStyle(bias_field=0.3)
    coefficients = site_draws(style, site_seed(1), 6, 6).bias_coefficients
    assert coefficients is not None and len(coefficients) == 10
    assert all(-0.3 <= c <= 0.3 for c in coefficients)
    t = np.linspace(-1.0, 1.0, 6)
    terms = [(i, j) for i in range(4) for j in range(i + 1)]  # np.tril_indices(4): (0,0), (1,0), (1,1), (2,0), ...
    field = sum(c * np.outer(legendre(i, t), legendre(j, t)) for c, (i, j) in zip(coefficients, terms, strict=True))
    expected = (x.double() * torch.as_tensor(np.exp(field))).clamp(0.0, 1.0).float()
    torch.testing.assert_close(apply_style(x, style, seed=site_seed(1)), expected, atol=1e-6, rtol=1e-6)
    # One field per site: every image and channel of the site gets the same gain at a pixel.
    gain = apply_style(x, style, seed=site_seed(1)) / x
    torch.testing.assert_close(gain[0], gain[1])


def test_bias_field_matches_monai_rand_bias_field():
    transforms = pytest.importorskip("monai.transforms")
    x = images(n=1, size=10)[0]
    for value in (0.05, -0.1):  # a degenerate range makes MONAI's draw the known coefficient vector
        monai = transforms.RandBiasField(degree=3, coeff_range=(value, value), prob=1.0)(x)
        ours = x.double() * torch.as_tensor(np.exp(log_bias_field([value] * 10, 10, 10)))
        torch.testing.assert_close(torch.as_tensor(np.asarray(monai)), ours.float(), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------ Rician noise


def test_rician_noise_is_the_magnitude_of_complex_gaussian_noise():
    x = images(channels=3, n=3, size=8, low=0.2, high=0.6)
    seed = site_seed(2)
    out = apply_style(x, SiteStyle(rician_noise=0.2), seed=seed)
    # The same private generator the style uses (like ``noise_std``): two normals per pixel, new ones per image.
    noise = torch.randn((2, *x.shape), generator=torch.Generator().manual_seed(stable_seed(seed, "rician_noise")))
    std = torch.stack([0.2 * img.std() for img in x]).view(-1, 1, 1, 1)  # relative to each image's own std
    expected = torch.sqrt((x + std * noise[0]) ** 2 + (std * noise[1]) ** 2).clamp(0.0, 1.0)
    torch.testing.assert_close(out, expected)
    assert not torch.equal(out[0] - x[0], out[1] - x[1]), "the noise should differ from image to image"


def test_rician_noise_has_monais_statistics():
    transforms = pytest.importorskip("monai.transforms")
    # Dim images with noise about twice their std (as in an MRI background): the Rician bias shows, and nothing
    # reaches the clamp at 1. 60 images of 32 x 32: the sample statistics below vary by about 1 % between seeds.
    x = images(n=60, size=32, low=0.0, high=0.2).double()
    relative = 2.0
    ours = apply_style(x.float(), SiteStyle(rician_noise=relative), seed=3).double()
    monai = transforms.RandRicianNoise(prob=1.0, std=relative, relative=True, sample_std=False)
    monai.set_random_state(seed=0)
    theirs = torch.stack([torch.as_tensor(np.asarray(monai(img))) for img in x.float()]).double()
    assert ours.max() < 1.0
    var = torch.stack([(relative * img.std()) ** 2 for img in x]).view(-1, 1, 1, 1)
    for out in (ours, theirs):
        # E[(x + n1)² + n2²] = x² + 2σ²: the second moment of the Rician distribution (standard error ~0.6 %).
        ratio = ((out**2 - x**2).mean() / (2 * var).mean()).item()
        assert abs(ratio - 1.0) < 0.03, ratio
    bias_ours, bias_theirs = (ours - x).mean().item(), (theirs - x).mean().item()
    assert bias_ours > 0.05 and abs(bias_ours / bias_theirs - 1.0) < 0.04, (bias_ours, bias_theirs)
    assert abs(ours.std().item() / theirs.std().item() - 1.0) < 0.02


# ------------------------------------------------------------------------------------------ Gibbs ringing


@pytest.mark.parametrize("alpha", [0.3, 0.7, 1.0])
@pytest.mark.parametrize("size", [(9, 9), (8, 12)])
def test_gibbs_is_monais_gibbs_noise(alpha, size):
    transforms = pytest.importorskip("monai.transforms")
    x = torch.rand(3, 2, *size, generator=torch.Generator().manual_seed(1))
    ours = apply_style(x, SiteStyle(gibbs=alpha), seed=0)
    theirs = torch.stack([torch.as_tensor(np.asarray(transforms.GibbsNoise(alpha=alpha)(img))) for img in x])
    torch.testing.assert_close(ours, theirs.clamp(0.0, 1.0), atol=1e-6, rtol=1e-6)


def test_gibbs_removes_high_frequencies():
    x = images(n=2, size=16, low=0.3, high=0.7)
    out = apply_style(x, SiteStyle(gibbs=0.7), seed=0)
    k = torch.fft.fftshift(torch.fft.fft2(out.double()), dim=(-2, -1)).abs()
    # Outside the disc nothing is left but float32 rounding (the zero frequency is about 128).
    assert k[..., 0, :].max() < 1e-5 and k[..., :, 0].max() < 1e-5
    assert k[..., 8, 8].min() > 50


# ------------------------------------------------------------------------------------------ k-space spikes


def test_kspace_spike_is_drawn_per_site_and_never_at_the_centre():
    style = SiteStyle(kspace_spikes=0.2)
    for site in range(40):
        row, col, amplitude = site_draws(style, site_seed(site), 8, 6).spike
        assert 0 <= row < 8 and 0 <= col < 6 and (row, col) != (4, 3)
        assert 0.1 <= amplitude <= 0.2


def test_kspace_spike_sets_the_drawn_k_space_magnitude():
    x = images(n=2, size=10, low=0.4, high=0.6)
    style = SiteStyle(kspace_spikes=0.05)  # stripes of amplitude <= 0.05: no clamping
    row, col, amplitude = site_draws(style, site_seed(1), 10, 10).spike
    out = apply_style(x, style, seed=site_seed(1))
    k_in = torch.fft.fftshift(torch.fft.fft2(x.double()), dim=(-2, -1))
    k_out = torch.fft.fftshift(torch.fft.fft2(out.double()), dim=(-2, -1))
    # The spike: magnitude a * H * W at the drawn point, the image's phase kept there.
    spiked = k_in.clone()
    spiked[..., row, col] = amplitude * 100 * torch.exp(1j * torch.angle(k_in[..., row, col]))
    # The image is the real part of its inverse transform: in k-space, the mean of the spectrum and its
    # conjugate mirror (frequency -f sits at index (10 - i) % 10 of the centred spectrum), so half the spike stays
    # at its point and half lands on the mirror point; every other frequency is unchanged.
    mirror = (10 - torch.arange(10)) % 10
    expected = (spiked + spiked[..., mirror, :][..., :, mirror].conj()) / 2
    torch.testing.assert_close(k_out, expected, atol=1e-3, rtol=1e-4)
    assert abs(k_out[..., row, col].abs().mean() - amplitude * 100 / 2) < 0.2 * amplitude * 100


def test_kspace_spike_matches_monais_kspace_spike_noise():
    transforms = pytest.importorskip("monai.transforms")
    x = torch.rand(3, 2, 9, 12, generator=torch.Generator().manual_seed(2))
    style = SiteStyle(kspace_spikes=0.3)
    row, col, amplitude = site_draws(style, site_seed(4), 9, 12).spike
    spike = transforms.KSpaceSpikeNoise(loc=(row, col), k_intensity=math.log(amplitude * 9 * 12))
    theirs = torch.stack([torch.as_tensor(np.asarray(spike(img))) for img in x])
    torch.testing.assert_close(apply_style(x, style, seed=site_seed(4)), theirs.clamp(0.0, 1.0), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------ H&E stain variation


def test_the_stain_matrix_is_ruifrok_and_johnstons():
    np.testing.assert_array_equal(RGB_FROM_HED, [[0.65, 0.70, 0.29], [0.07, 0.99, 0.11], [0.27, 0.57, 0.78]])
    np.testing.assert_allclose(HED_FROM_RGB @ RGB_FROM_HED, np.eye(3), atol=1e-12)


def test_hed_round_trip_is_the_identity():
    x = torch.rand(5, 3, 7, 7, generator=torch.Generator().manual_seed(3))
    x[0, :, 0, 0] = 0.0  # black and white are kept too
    x[0, :, 0, 1] = 1.0
    torch.testing.assert_close(hed_to_rgb(rgb_to_hed(x)).float(), x, atol=1e-5, rtol=0)
    # A pure haematoxylin colour deconvolves to haematoxylin alone.
    colour = torch.exp(-0.8 * torch.tensor(RGB_FROM_HED[0])).view(1, 3, 1, 1)
    torch.testing.assert_close(rgb_to_hed(colour).flatten(), torch.tensor([0.8, 0.0, 0.0], dtype=torch.float64))


def test_stain_jitter_on_known_colours():
    style = SiteStyle(stain_he=0.2)
    draws = site_draws(style, site_seed(1), 1, 2)
    scale, shift = np.array(draws.stain_scale), np.array(draws.stain_shift)
    assert np.all((0.8 <= scale) & (scale <= 1.2)) and np.all((-0.2 <= shift) & (shift <= 0.2))
    haematoxylin = np.exp(-0.8 * RGB_FROM_HED[0])  # optical densities (0.8, 0, 0)
    white = np.ones(3)  # no stain at all
    x = torch.tensor(np.stack([haematoxylin, white], axis=1), dtype=torch.float32).view(1, 3, 1, 2)
    out = apply_style(x, style, seed=site_seed(1))
    for pixel, hed in ((0, np.array([0.8, 0.0, 0.0])), (1, np.zeros(3))):
        expected = np.clip(np.exp(-((hed * scale + shift) @ RGB_FROM_HED)), 0.0, 1.0)
        np.testing.assert_allclose(out[0, :, 0, pixel].numpy(), expected, atol=1e-6)


def test_stain_he_refuses_gray_images_naming_the_style():
    for channels in (1, 2):
        with pytest.raises(ValueError, match=f"stain_he.*3-channel RGB.*got {channels} channel"):
            apply_style(images(channels), SiteStyle(stain_he=0.1), seed=0)
    dm = DigitsFederated(num_clients=2, image_size=8, site_styles=["clean", "stain_he"])
    with pytest.raises(ValueError, match="stain_he"):
        dm.setup()


# ------------------------------------------------------------------------------------------ in a datamodule


def test_a_digits_datamodule_builds_with_the_mri_styles():
    specs = ["clean", "bias_field", "rician_noise", {"gibbs": 0.7}, "kspace_spikes+bias_field=0.2"]
    kwargs = {"num_clients": 5, "image_size": 16, "max_samples_per_client": 40}
    styled, again = DigitsFederated(site_styles=specs, **kwargs), DigitsFederated(site_styles=specs, **kwargs)
    plain = DigitsFederated(site_styles=False, **kwargs)
    for dm in (styled, again, plain):
        dm.setup()
    for i, cid in enumerate(styled.client_ids):
        got, raw = styled.client_data(cid), plain.client_data(cid)
        assert torch.equal(got.train_x, again.client_data(cid).train_x), "not deterministic"
        assert got.train_x.min() >= 0.0 and got.train_x.max() <= 1.0
        assert torch.equal(got.train_y, raw.train_y)
        assert torch.equal(got.train_x, raw.train_x) == (i == 0)
    # Site 1 is exactly its style applied once to its images with its seed.
    expected = apply_style(plain.client_data("site1").train_x, SiteStyle(bias_field=0.3), seed=site_seed(1))
    torch.testing.assert_close(styled.client_data("site1").train_x, expected)


def test_an_rgb_digits_datamodule_builds_with_stain_he():
    dm = DigitsFederated(num_clients=2, image_size=8, channels=3, site_styles=["clean", "stain_he"])
    dm.setup()
    x = dm.client_data("site1").train_x
    assert x.shape[1] == 3 and x.min() >= 0.0 and x.max() <= 1.0
    assert not torch.equal(x[:, 0], x[:, 1]), "the gray digits should be stained (channels no longer equal)"
    gray = dm.client_data("site0").train_x
    assert torch.equal(gray[:, 0], gray[:, 1])


def test_an_rgb_medmnist_file_takes_stain_he_without_setting_channels(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 40), ("val", 10), ("test", 10)):
        arrays[f"{split}_images"] = rng.integers(0, 255, (n, 28, 28, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 2, (n, 1))
    np.savez(tmp_path / "path.npz", **arrays)
    dm = MedMNISTFederated(tmp_path / "path.npz", num_clients=2, site_styles=["stain_he", "stain_he=0.1"])
    dm.setup()
    assert dm.client_data(dm.client_ids[0]).train_x.shape[1] == 3


def test_the_cli_takes_the_new_names_parameters_and_mappings():
    from fl_lightning.cli import build_cli

    styles = '[clean, bias_field, "rician_noise=0.2+gibbs=0.5", {gibbs: 0.7}, {kspace_spikes: 0.1, bias_field: 0.2}]'
    cli = build_cli(
        ["--config", "configs/fedavg_digits.yaml", "--trainer.logger=false", f"--data.site_styles={styles}"]
    )
    assert resolve_site_styles(cli.datamodule.site_styles, 5, seed=0) == [
        SiteStyle(),
        SiteStyle(bias_field=0.3),
        SiteStyle(rician_noise=0.2, gibbs=0.5),
        SiteStyle(gibbs=0.7),
        SiteStyle(kspace_spikes=0.1, bias_field=0.2),
    ]
