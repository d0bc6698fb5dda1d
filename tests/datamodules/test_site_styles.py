"""Choosing site styles: ``true`` unchanged bit for bit, a list of named or parameterised styles per site."""

from __future__ import annotations

import hashlib
import json
import sys
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


def describe(dm) -> dict:
    """What a datamodule generated: labels, domains and shapes bit for bit (a digest), images as float sums.

    Labels and domains are integers drawn from seeded generators: equal on any machine. The images pass through
    float kernels (resizing, blur, gamma, noise) whose last bits depend on the CPU's kernels (AVX-512, AVX2,
    ARM accumulate in other orders; measured here: 1e-9 relative on these sums under ATEN_CPU_CAPABILITY=default
    vs avx512), so each image tensor is kept as four sums — plain, of squares, position-weighted (a reordering
    moves it) and of absolute values — compared within SUM_TOLERANCE of the absolute sum.
    """
    dm.setup()
    h = hashlib.sha256()
    sums = []
    for cid in dm.client_ids:
        d = dm.client_data(cid)
        for t in (d.train_y, d.test_y, d.train_domain, d.test_domain):
            if t is not None:
                h.update(t.contiguous().numpy().tobytes())
        for x in (d.train_x, d.test_x):
            h.update(repr(tuple(x.shape)).encode())
            x = x.double().flatten()
            w = torch.arange(1, len(x) + 1, dtype=torch.float64) / len(x)
            sums.append([float(x.sum()), float((x * x).sum()), float((x * w).sum()), float(x.abs().sum())])
    return {"exact": h.hexdigest()[:16], "sums": sums}


# A float32 kernel may differ by a few units in the last place per pixel (4 ulp ≈ 2.4e-7 relative); a sum then
# differs by at most that fraction of the sum of absolute values (twice that for the squares): 1e-6 leaves room.
SUM_TOLERANCE = 1e-6


def assert_same_data(got: dict, want: dict) -> None:
    assert got["exact"] == want["exact"], "labels, domains or shapes differ"
    assert len(got["sums"]) == len(want["sums"])
    for i, (g, w) in enumerate(zip(got["sums"], want["sums"])):
        scale = max(w[3], 1e-12)
        for k, (a, b) in enumerate(zip(g, w)):
            bound = SUM_TOLERANCE * (scale if k != 1 else 2 * max(w[1], 1e-12))
            assert abs(a - b) <= bound, (i, k, a, b)


def fake_medmnist(path: Path) -> Path:
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 120), ("val", 20), ("test", 40)):
        arrays[f"{split}_images"] = rng.integers(0, 255, (n, 28, 28, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 4, (n, 1))
    np.savez(path, **arrays)
    return path


# ``site_styles: true`` as the code generated it before styles could be chosen (commit 7a3ed5e, whose digests this
# code reproduced bit for bit); regenerate only for a change meant to alter the data: python -m
# tests.datamodules.test_site_styles --write
BEFORE_FILE = Path(__file__).with_name("site_styles_before.json")
BEFORE = json.loads(BEFORE_FILE.read_text()) if BEFORE_FILE.is_file() else {}
NAMES = ["digits_iid7", "digits_rgb7", "digits_domain8", "digits_dirdom6", "seg6", "medmnist6"]


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


@pytest.mark.kernels
@pytest.mark.parametrize("name", NAMES)
def test_true_is_unchanged_from_before(name, tmp_path):
    assert_same_data(describe(build(name, tmp_path)), BEFORE[name])


def test_the_comparison_can_fail(tmp_path):
    want = BEFORE["digits_iid7"]
    moved = {**want, "sums": [list(want["sums"][0]), *want["sums"][1:]]}
    moved["sums"][0][2] *= 1 + 1e-5  # one image tensor reordered or changed a little
    with pytest.raises(AssertionError):
        assert_same_data(moved, want)
    with pytest.raises(AssertionError, match="labels"):
        assert_same_data({**want, "exact": "0" * 16}, want)


@pytest.mark.parametrize("name", ["digits_iid7", "seg6"])  # gray: true tints RGB sites, a list of names does not
def test_the_default_sequence_by_name_equals_true_for_gray_sites(name, tmp_path):
    n = 7 if name == "digits_iid7" else 6
    names = [*DEFAULT_SITE_SEQUENCE, *["random"] * (n - len(DEFAULT_SITE_SEQUENCE))]
    by_name, true = build(name, tmp_path, site_styles=names), build(name, tmp_path)
    by_name.setup()
    true.setup()
    for cid in true.client_ids:  # one process: bit for bit
        for attr in ("train_x", "train_y", "test_x", "test_y"):
            assert torch.equal(getattr(by_name.client_data(cid), attr), getattr(true.client_data(cid), attr)), attr


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


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        BEFORE_FILE.write_text(json.dumps({n: describe(build(n, Path(tmp))) for n in NAMES}, indent=1) + "\n")
