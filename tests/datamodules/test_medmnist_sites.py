"""MedMNIST .npz files with a site per image (``site_key``): each site a client, the errors, one round."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import MedMNISTFederated
from fl_lightning.cli import main

SIZES = {"train": 40, "val": 10, "test": 10}


def _write(path: Path, sites: dict[str, np.ndarray] | None = None, key: str = "site") -> Path:
    """60 gray 28x28 images whose first pixel is the image's number (0..59), 4 classes, sites 0/1/2 by number."""
    arrays: dict[str, np.ndarray] = {}
    start = 0
    for split, n in SIZES.items():
        number = np.arange(start, start + n)
        images = np.random.default_rng(start).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        images[:, 0, 0] = number
        arrays[f"{split}_images"] = images
        arrays[f"{split}_labels"] = (number % 4).reshape(n, 1).astype(np.uint8)
        arrays[f"{split}_{key}"] = number % 3 if sites is None else sites[split]
        start += n
    np.savez(path, **arrays)
    return path


def _numbers(dm: MedMNISTFederated, cid: str) -> list[int]:
    data = dm.client_data(cid)
    return (torch.cat([data.train_x, data.test_x])[:, 0, 0, 0] * 255).round().long().tolist()


def test_each_site_is_a_client(tmp_path: Path) -> None:
    dm = MedMNISTFederated(_write(tmp_path / "sites.npz"), site_key="site")
    assert dm.client_ids == ["site0", "site1", "site2"] and dm.site_names == ["site0", "site1", "site2"]
    for s, cid in enumerate(dm.client_ids):
        assert sorted(_numbers(dm, cid)) == [i for i in range(60) if i % 3 == s]
        data = dm.client_data(cid)
        assert set(torch.cat([data.train_domain, data.test_domain]).tolist()) == {s}
        assert dm.image_sources(cid) == ([cid] * len(data.train_y), "sites")
    assert dm.num_classes == 4


def test_string_sites_and_clients_per_site(tmp_path: Path) -> None:
    names = np.array(["hospB", "hospA"])
    sites = {split: names[np.arange(n) % 2] for split, n in SIZES.items()}
    dm = MedMNISTFederated(_write(tmp_path / "s.npz", sites), site_key="site")
    assert dm.client_ids == ["hospA", "hospB"]
    split = MedMNISTFederated(_write(tmp_path / "k.npz"), site_key="site", clients_per_site=2, partition="dirichlet")
    assert split.client_ids == [f"site{s}_{k}" for s in range(3) for k in range(2)]
    seen = [i for cid in split.client_ids for i in _numbers(split, cid)]
    assert sorted(seen) == list(range(60))
    assert set(_numbers(split, "site1_0")) | set(_numbers(split, "site1_1")) == set(range(1, 60, 3))


def test_missing_site_arrays_name_the_key_and_list_the_keys(tmp_path: Path) -> None:
    path = _write(tmp_path / "other.npz", key="hospital")
    with pytest.raises(KeyError, match=r"'train_site' \(site_key='site'.*other\.npz.*keys present: .*train_hospital"):
        MedMNISTFederated(path, site_key="site").setup()
    bad = _write(tmp_path / "bad.npz", {**{s: np.arange(n) % 3 for s, n in SIZES.items()}, "val": np.zeros(3)})
    with pytest.raises(ValueError, match=r"bad\.npz: val_site must hold one site id per val image, shape \(10,\)"):
        MedMNISTFederated(bad, site_key="site").setup()


def test_synthetic_partition_options_are_refused_naming_them(tmp_path: Path) -> None:
    path = tmp_path / "unused.npz"
    with pytest.raises(ValueError, match=r"site_key='site'.*num_clients=10, site_styles=True.*num_clients=5"):
        MedMNISTFederated(path, site_key="site", num_clients=10, site_styles=True)
    with pytest.raises(ValueError, match=r"partition='dirichlet' would have no effect.*clients_per_site > 1"):
        MedMNISTFederated(path, site_key="site", partition="dirichlet")
    with pytest.raises(ValueError, match="clients_per_site=2 needs site_key"):
        MedMNISTFederated(path, clients_per_site=2)
    MedMNISTFederated(path, site_key="site", partition="dirichlet", alpha=0.1, clients_per_site=2)


def test_one_round_through_the_cli(tmp_path: Path) -> None:
    path = _write(tmp_path / "sites.npz")
    summary = main([
        "--config", "configs/fedavg_medmnist.yaml", f"--data.path={path}", "--data.site_key=site",
        "--data.num_clients=5", "--data.partition=iid", "--data.image_size=8", "--model.init_args.width=4",
        "--trainer.logger=false", "--federation.rounds=1", "--federation.progress=false", "--federation.plots=false",
        f"--federation.output_dir={tmp_path / 'runs'}",
    ])  # fmt: skip
    assert set(summary["clients"]) == {"site0", "site1", "site2"} and summary["rounds"] == 1
