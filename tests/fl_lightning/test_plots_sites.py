"""sites.png: example training images per client, their site styles, masks overlaid; written with the run's figures."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from datamodules import DigitsFederated, DigitsSegFederated
from datamodules.shifts import style_name
from fl_lightning.outputs import plots, sites
from fl_lightning.outputs.sites import evenly_spaced, site_examples
from tests.conftest import build_federation, tiny_data


def _classification(n: int, size: int = 16, channels: int = 1, seed: int = 0) -> dict[str, sites.SiteExamples]:
    rng = np.random.default_rng(seed)
    return {
        f"site{i}": sites.SiteExamples(
            rng.random((6, channels, size, size), dtype=np.float32), None, [str(d) for d in range(6)], "clean", 40
        )
        for i in range(n)
    }


def _segmentation(n: int, size: int = 24, channels: int = 3) -> dict[str, sites.SiteExamples]:
    rng = np.random.default_rng(1)
    out = {}
    for i in range(n):
        masks = np.zeros((6, size, size), dtype=np.int64)
        masks[:, 2:8, 2:8] = 1 + i % 4  # one square of a foreground class per image
        out[f"site{i}"] = sites.SiteExamples(rng.random((6, channels, size, size)), masks, None, f"style {i}", 30)
    return out


def _png(tmp_path, examples, name="sites.png", **kwargs) -> tuple[bytes, np.ndarray]:
    path = tmp_path / name
    sites.plot_sites(examples, path, **kwargs)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(io.BytesIO(data)) as image:
        return data, np.asarray(image)


def _montages(fig) -> list[np.ndarray]:
    """The image drawn in each row (one montage of the client's examples per axes)."""
    return [np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images]


@pytest.mark.parametrize("channels", [1, 3])
def test_classification_sites_png_is_small_sized_and_reproducible(tmp_path, channels):
    examples = _classification(5, channels=channels)
    first, pixels = _png(tmp_path, examples)
    again, _ = _png(tmp_path, _classification(5, channels=channels), name="again.png")
    assert first == again  # same inputs, same bytes
    height, width = pixels.shape[:2]
    assert 600 <= width <= 900 and 700 <= height <= 1100, pixels.shape  # ~1 inch per image, a row per client
    assert len(first) < 200_000
    assert pixels.ndim == (2 if channels == 1 else 3)  # grey figures are stored as 8-bit grey


def test_segmentation_sites_png_overlays_masks_and_is_reproducible(tmp_path):
    first, pixels = _png(tmp_path, _segmentation(4), class_names=["background", "a", "b", "c", "d"])
    again, _ = _png(tmp_path, _segmentation(4), name="again.png", class_names=["background", "a", "b", "c", "d"])
    assert first == again
    assert 600 <= pixels.shape[1] <= 900 and 600 <= pixels.shape[0] <= 1000, pixels.shape
    fig = sites.sites_figure(_segmentation(4), class_names=["background", "a", "b", "c", "d"])
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    plots.pyplot().close(fig)
    assert legend == ["a", "b", "c", "d"]  # the classes shown, named; never the background


def test_mask_colours_cover_the_foreground_only():
    images = np.full((1, 1, 8, 8), 0.5)
    masks = np.zeros((1, 8, 8), dtype=np.int64)
    masks[0, :4] = 2
    rgb = sites._display(sites.SiteExamples(images, masks), fixed=True)[0]
    assert np.allclose(rgb[4:], 0.5)  # background: the image, untouched
    expected = (1 - sites.MASK_ALPHA) * 0.5 + sites.MASK_ALPHA * np.asarray(sites._class_colour(2))
    assert np.allclose(rgb[:4], expected)


def test_intensities_in_the_unit_range_are_shown_as_stored_and_others_min_max_per_client():
    low_contrast = np.linspace(0.4, 0.6, 16).reshape(1, 1, 4, 4)
    shown = sites._display(sites.SiteExamples(low_contrast), fixed=True)
    assert np.allclose(shown[..., 0], low_contrast[:, 0])  # the site's low contrast stays visible
    normalised = np.stack([low_contrast[0] * 10 - 5, low_contrast[0] * 20 - 10])  # two images, outside [0, 1]
    stretched = sites._display(sites.SiteExamples(normalised), fixed=False)
    assert stretched.min() == 0.0 and stretched.max() == 1.0
    assert stretched[0].max() < 1.0  # scaled with the client's other image, not on its own
    fig = sites.sites_figure({"a": sites.SiteExamples(normalised)})
    assert "min-max scaled per client" in fig._suptitle.get_text()
    plots.pyplot().close(fig)


def test_at_most_twelve_clients_are_drawn_and_the_title_says_of_how_many():
    fig = sites.sites_figure(_classification(20, size=8), total_clients=20)
    rows, title = len(_montages(fig)), fig._suptitle.get_text()
    titles = [ax.get_title(loc="left") for ax in fig.axes if ax.images]
    plots.pyplot().close(fig)
    assert rows == sites.MAX_SITE_ROWS == 12
    assert "the first 12 of 20 clients" in title
    assert titles[0] == "site0 · clean   (40 training images)"


def test_examples_are_evenly_spaced_and_deterministic():
    assert evenly_spaced(100, 6).tolist() == [0, 20, 40, 59, 79, 99]
    assert evenly_spaced(3, 6).tolist() == [0, 1, 2]
    data = tiny_data(num_clients=3)
    first, again = site_examples(data), site_examples(tiny_data(num_clients=3))
    assert list(first) == ["site0", "site1", "site2"]
    for cid in first:
        assert np.array_equal(first[cid].images, again[cid].images)
        split = data.client_data(cid)
        pick = evenly_spaced(len(split.train_y), 6)
        assert np.array_equal(first[cid].images, split.train_x[pick].numpy())
        assert list(first[cid].captions) == [str(int(y)) for y in split.train_y[pick]]  # each image's class


def test_rows_name_each_clients_site_style():
    examples = site_examples(tiny_data(num_clients=3))
    assert [e.name for e in examples.values()] == ["clean", "gamma_low_contrast", "inverted"]
    listed = site_examples(tiny_data(num_clients=2, site_styles=["dark", {"contrast": 0.5}]))
    assert [e.name for e in listed.values()] == ["dark", "contrast=0.5"]
    unstyled = site_examples(tiny_data(num_clients=2, site_styles=False))
    assert [e.name for e in unstyled.values()] == ["domain 0", "domain 1"]  # no styles: the data's domain ids
    assert style_name(True, 7) == "random style"


def test_clients_of_several_styles_caption_each_image_with_its_style():
    data = DigitsFederated(num_clients=3, image_size=8, partition="dirichlet_domain", seed=0)
    examples = site_examples(data)
    mixed = [e for e in examples.values() if e.name and e.name.endswith("styles")]
    assert mixed, [e.name for e in examples.values()]
    for e in mixed:
        class_, style = e.captions[0].split("\n")
        assert class_.isdigit() and style in ("clean", "gamma_low_contrast", "inverted")


def test_segmentation_examples_carry_masks_and_digit_names():
    data = DigitsSegFederated(num_clients=2, image_size=12, num_samples=40, seed=0)
    examples = site_examples(data)
    first = examples["site0"]
    assert first.masks is not None and first.masks.shape == (len(first.images), 12, 12)
    assert first.captions is None and first.name == "clean"
    assert data.label_names() == ["background", "digit 0", "digit 1", "digit 3", "digit 4"]


def test_a_run_with_plots_writes_sites_png_and_one_without_does_not(tmp_path):
    fed = build_federation(tmp_path / "on", rounds=1, plots=True, checkpoint_every=0)
    fed.run()
    data = (fed.run_dir.path / "sites.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000
    off = build_federation(tmp_path / "off", rounds=1, plots=False, checkpoint_every=0)
    off.run()
    assert not (off.run_dir.path / "sites.png").exists()
