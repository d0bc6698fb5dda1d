"""The recipes for real multi-site data run one round on small synthetic files laid out as the docs say."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fl_lightning.cli import main

nib = pytest.importorskip("nibabel", reason="the recipes need the `medical` extra: pip install -e '.[medical]'")

PROSTATE_SITES = ["BIDMC", "HK", "I2CVB", "ISBI", "ISBI_1.5", "UCL"]
TINY = ["--trainer.logger=false", "--federation.rounds=1", "--federation.eval_every=1",
        "--federation.progress=false", "--federation.plots=false"]  # fmt: skip


def prostate_root(root: Path, cases: int = 2) -> Path:
    """``root/<site>/{images,labels}/<case>.nii.gz``: 16×16×4 volumes, a gland-like blob labelled 1 or 2."""
    rng = np.random.default_rng(0)
    for s, site in enumerate(PROSTATE_SITES):
        for c in range(cases):
            image = rng.normal(100 + 20 * s, 10, (16, 16, 4)).astype(np.float32)
            label = np.zeros((16, 16, 4), dtype=np.uint8)
            label[5:11, 5:11, 1:3] = 1 + (c % 2)  # the two zones some sites label separately
            image[label > 0] += 60
            for kind, data in (("images", image), ("labels", label)):
                (root / site / kind).mkdir(parents=True, exist_ok=True)
                nib.save(nib.Nifti1Image(data, np.eye(4)), str(root / site / kind / f"case{c:02d}.nii.gz"))
    return root


@pytest.mark.parametrize("config", ["fedavg", "fedprox", "fedbn", "harmofl"])
def test_the_prostate_recipes_run_one_round_on_files_laid_out_as_documented(config, tmp_path):
    root = prostate_root(tmp_path / "prostate")
    summary = main([
        "--config", f"configs/{config}_prostate.yaml", f"--data.root={root}", "--data.image_size=16",
        "--data.test_fraction=0.5", "--model.init_args.width=4", "--model.init_args.depth=1", *TINY,
        f"--federation.output_dir={tmp_path / 'runs'}", "--federation.run_name=r",
    ])  # fmt: skip
    assert sorted(summary["clients"]) == sorted(PROSTATE_SITES)
    assert {"dice", "hd95", "surface_dice"} <= set(summary["summary"]["global"])
    assert "hd95" in json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())["pooled"]


CAMELYON_CENTERS = [0, 1, 2, 3, 4]


def uci_heart_root(root: Path, per_centre: int = 24) -> Path:
    """The four UCI heart-disease ``processed.*.data`` files (no header, 14 columns, ``?`` cells), random rows."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for c, name in enumerate(("cleveland", "hungarian", "switzerland", "va")):
        lines = []
        for i in range(per_centre):
            row = [rng.integers(30, 75), rng.integers(0, 2), rng.integers(1, 5), rng.integers(100, 180),
                   rng.integers(150, 350), rng.integers(0, 2), rng.integers(0, 3), rng.integers(90, 200),
                   rng.integers(0, 2), round(float(rng.uniform(0, 4)), 1), "?", "?", "?", (i + c) % 3]  # fmt: skip
            lines.append(",".join(f"{v}.0" if isinstance(v, np.integer) else str(v) for v in row))
        (root / f"processed.{name}.data").write_text("\n".join(lines) + "\n")
    return root


def camelyon_table(root: Path, per_center: int = 6) -> Path:
    """A Camelyon17-WILDS-shaped ``metadata.csv`` with its patch PNGs under ``patches/`` (16 px, tumour or not)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = ["patient,node,x_coord,y_coord,tumor,slide,center,split"]
    for center in CAMELYON_CENTERS:
        for i in range(per_center):
            patient, node, x, y, tumor = 10 * center + i // 3, i % 3, 100 + i, 200 + i, i % 2
            folder = root / "patches" / f"patient_{patient:03d}_node_{node}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 120, (16, 16, 3), dtype=np.uint8) + np.uint8(100 * tumor)
            name = f"patch_patient_{patient:03d}_node_{node}_x_{x}_y_{y}.png"
            Image.fromarray(pixels).save(folder / name)
            rows.append(f"{patient},{node},{x},{y},{tumor},{patient},{center},0")
    (root / "metadata.csv").write_text("\n".join(rows) + "\n")
    return root / "metadata.csv"
