"""Choosing site styles: ``true`` unchanged bit for bit, a list of named or parameterised styles per site."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import DigitsFederated, DigitsSegFederated, MedMNISTFederated
from datamodules.shifts import (
    DEFAULT_SITE_SEQUENCE,
    NAMED_STYLES,
    SiteStyle,
    default_site_styles,
    parse_style,
    resolve_site_styles,
)


def digest(dm) -> str:
    """sha256 prefix of every client's tensors (images, labels, domains)."""
    dm.setup()
    h = hashlib.sha256()
    for cid in dm.client_ids:
        d = dm.client_data(cid)
        for t in (d.train_x, d.train_y, d.test_x, d.test_y):
            h.update(t.contiguous().numpy().tobytes())
        for t in (d.train_domain, d.test_domain):
            if t is not None:
                h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def fake_medmnist(path: Path) -> Path:
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 120), ("val", 20), ("test", 40)):
        arrays[f"{split}_images"] = rng.integers(0, 255, (n, 28, 28, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 4, (n, 1))
    np.savez(path, **arrays)
    return path


# Digests of ``site_styles: true`` computed with the code before styles could be chosen (commit 7a3ed5e).
BEFORE = {
    "digits_iid7": "f2be4f45e48ae82f",
    "digits_rgb7": "c3e9eccb7c1f5643",
    "digits_domain8": "a954363a4a286735",
    "digits_dirdom6": "0094740f69acbe9f",
    "seg6": "02d736e622120ec4",
    "medmnist6": "2dd6907709ab59ea",
}


def build(name: str, tmp_path: Path, site_styles=True):
    small = {"image_size": 8, "max_samples_per_client": 40, "site_styles": site_styles}
    return {
        "digits_iid7": lambda: DigitsFederated(num_clients=7, **small),
        "digits_rgb7": lambda: DigitsFederated(num_clients=7, channels=3, **small),
        "digits_domain8": lambda: DigitsFederated(num_clients=8, partition="domain", **small),
        "digits_dirdom6": lambda: DigitsFederated(num_clients=6, partition="dirichlet_domain", **small),
        "seg6": lambda: DigitsSegFederated(num_clients=6, image_size=16, num_samples=60, site_styles=site_styles),
        "medmnist6": lambda: MedMNISTFederated(
            fake_medmnist(tmp_path / "m.npz"), num_clients=6, site_styles=site_styles
        ),
    }[name]()


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_true_is_bit_identical_to_before(name, tmp_path):
    assert digest(build(name, tmp_path)) == BEFORE[name]


@pytest.mark.parametrize("name", ["digits_iid7", "seg6"])  # gray: true tints RGB sites, a list of names does not
def test_the_default_sequence_by_name_equals_true_for_gray_sites(name, tmp_path):
    n = 7 if name == "digits_iid7" else 6
    names = [*DEFAULT_SITE_SEQUENCE, *["random"] * (n - len(DEFAULT_SITE_SEQUENCE))]
    assert digest(build(name, tmp_path, site_styles=names)) == BEFORE[name]


def test_named_styles_are_applied_per_site():
    plain = DigitsFederated(num_clients=3, image_size=8, max_samples_per_client=30, site_styles=False)
    styled = DigitsFederated(
        num_clients=3, image_size=8, max_samples_per_client=30, site_styles=["clean", "inverted", "low_contrast"]
    )
    plain.setup()
    styled.setup()
    x = {c: plain.client_data(c).train_x for c in plain.client_ids}
    torch.testing.assert_close(styled.client_data("site0").train_x, x["site0"])
    torch.testing.assert_close(styled.client_data("site1").train_x, 1.0 - x["site1"])
    torch.testing.assert_close(styled.client_data("site2").train_x, (x["site2"] - 0.5) * 0.5 + 0.5)


def test_a_list_sets_the_domains_of_the_domain_partitions():
    dm = DigitsFederated(
        num_clients=6, image_size=8, partition="domain", site_styles=["clean", "dark", "noisy"], seed=1
    )
    dm.setup()
    seen = set()
    for cid in dm.client_ids:
        seen |= set(dm.client_data(cid).train_domain.tolist())
    assert seen == {0, 1, 2}


def test_segmentation_and_medmnist_take_a_list(tmp_path):
    seg = DigitsSegFederated(num_clients=2, image_size=16, num_samples=20, site_styles=["clean", "inverted"])
    plain = DigitsSegFederated(num_clients=2, image_size=16, num_samples=20, site_styles=False)
    seg.setup()
    plain.setup()
    torch.testing.assert_close(seg.client_data("site1").train_x, 1.0 - plain.client_data("site1").train_x)
    med = MedMNISTFederated(fake_medmnist(tmp_path / "m.npz"), num_clients=2, site_styles=["clean", "dark"])
    raw = MedMNISTFederated(tmp_path / "m.npz", num_clients=2)
    med.setup()
    raw.setup()
    torch.testing.assert_close(med.client_data("client1").train_x, raw.client_data("client1").train_x ** 1.8)


# ------------------------------------------------------------------------------------------ the specs


def test_each_named_style_is_its_documented_parameters():
    for name, params in NAMED_STYLES.items():
        assert parse_style(name) == SiteStyle(**params)
    assert parse_style("gamma_low_contrast") == default_site_styles(2, seed=0)[1]


def test_parameters_on_top_of_a_name():
    assert parse_style("low_contrast+noise_std=0.05") == SiteStyle(contrast=0.5, noise_std=0.05)
    assert parse_style("contrast=0.7 + blur_sigma=0.8") == SiteStyle(contrast=0.7, blur_sigma=0.8)
    assert parse_style("dark+gamma=1.2") == SiteStyle(gamma=1.2)  # later parts override earlier ones
    assert parse_style("invert=true+tint=1/0.8/0.6") == SiteStyle(invert=True, tint=(1.0, 0.8, 0.6))
    assert parse_style({"contrast": 0.7, "tint": [1, 1, 0.5]}) == SiteStyle(contrast=0.7, tint=(1.0, 1.0, 0.5))
    assert parse_style(SiteStyle(gain=0.7)) == SiteStyle(gain=0.7)


def test_random_is_the_sites_seeded_random_style():
    assert parse_style("random", seed=3, site=6) == default_site_styles(7, seed=3)[6]
    assert parse_style("random", seed=3, site=6) != parse_style("random", seed=4, site=6)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("xray", "unknown style 'xray'.*named styles: clean"),
        ("low_contrast+sharpness=2", "unknown parameter 'sharpness'"),
        ("contrast=high", "cannot read contrast='high'"),
        ("invert=maybe", "cannot read invert='maybe'"),
        ("gamma=0", "site style 'gamma=0'.*gamma=0.0"),
        ("noise_std=-0.1", "noise_std=-0.1"),
        ("tint=1/0.5", "tint"),
        ({"contrast": 0.5, "sharpness": 2}, "unknown parameter.*sharpness"),
        ("", "a site style is"),
    ],
)
def test_bad_specs_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_style(spec)


def test_the_list_needs_one_style_per_site():
    assert resolve_site_styles(False, 3, seed=0) is None
    assert resolve_site_styles(True, 3, seed=0) == default_site_styles(3, seed=0)
    with pytest.raises(ValueError, match="2 styles for 3 sites"):
        resolve_site_styles(["clean", "dark"], 3, seed=0)
    with pytest.raises(ValueError, match="empty list"):
        resolve_site_styles([], 3, seed=0)
    with pytest.raises(ValueError, match="one style per site"):
        resolve_site_styles("dark", 3, seed=0)


def test_datamodules_refuse_a_bad_list_when_built():
    with pytest.raises(ValueError, match="2 styles for 3 sites"):
        DigitsFederated(num_clients=3, site_styles=["clean", "dark"])
    with pytest.raises(ValueError, match="unknown style 'xray'"):
        DigitsSegFederated(num_clients=2, site_styles=["clean", "xray"])


def test_the_cli_takes_names_parameters_and_mappings():
    from fl_lightning.cli import build_cli

    styles = '[clean, dark, "low_contrast+noise_std=0.05", {contrast: 0.7, gamma: 1.2}, inverted]'
    cli = build_cli(
        ["--config", "configs/fedavg_digits.yaml", "--trainer.logger=false", f"--data.site_styles={styles}"]
    )
    resolved = resolve_site_styles(cli.datamodule.site_styles, 5, seed=0)
    assert resolved == [
        SiteStyle(),
        SiteStyle(gamma=1.8),
        SiteStyle(contrast=0.5, noise_std=0.05),
        SiteStyle(contrast=0.7, gamma=1.2),
        SiteStyle(invert=True),
    ]
