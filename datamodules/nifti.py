"""NIfTI image/label volumes per site (``.nii``/``.nii.gz``), sliced to 2D, for segmentation.

nibabel (the ``medical`` extra) is imported only when a volume is read, so ``import datamodules`` stays light.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from typing_extensions import override

from datamodules.base import ClientSplit, FederatedDataModule, check_image_args
from datamodules.image_folder import _visible_dirs
from datamodules.sampler import stable_seed
from datamodules.volumes import (
    NORMALIZE_MODES,
    NormalizeMode,
    SliceMode,
    check_pair,
    map_labels,
    normalize_volume,
    read_volume,
    resize_slices,
    select_slices,
    take_slices,
)

NIFTI_SUFFIXES = (".nii.gz", ".nii")
_SLICE_MODES = ("foreground", "all")
_SPLITS = ("train", "test", "val")  # a split column's values; "val" rows are the official validation split
_CSV_COLUMNS = ("image", "label", "site")


@dataclass(frozen=True)
class Case:
    """One image volume and its label volume.

    Attributes:
        site: The site (hospital) the case belongs to.
        case: The case (patient) id: the file name without ``.nii``/``.nii.gz`` for the folder layout; the CSV's
            ``case`` column, else the image path as written in the CSV, for a CSV index. Rows of one site with the
            same case id are one patient: they always land in the same client and the same split.
        image: The image volume's file.
        label: The label volume's file.
        split: ``"train"``, ``"test"`` or ``"val"`` when given by the CSV's ``split`` column, else None (seeded).
    """

    site: str
    case: str
    image: Path
    label: Path
    split: str | None = None


# --------------------------------------------------------------------------------------------- pure helpers


def case_name(path: Path) -> str | None:
    """The case name of a NIfTI file: its name without ``.nii.gz`` or ``.nii`` (any case), or None if not NIfTI.

    Args:
        path: A file path.

    Returns:
        ``"case01"`` for ``case01.nii.gz`` or ``case01.NII``; None for ``case01.png``.
    """
    lower = path.name.lower()
    for suffix in NIFTI_SUFFIXES:
        if lower.endswith(suffix) and len(lower) > len(suffix):
            return path.name[: -len(suffix)]
    return None


def nifti_files(directory: Path, site: str) -> dict[str, Path]:
    """The NIfTI files of one folder by case name. Hidden entries (``.DS_Store``, ``._case.nii.gz``) are skipped.

    Args:
        directory: An ``images/`` or ``labels/`` folder.
        site: The site, for the messages.

    Returns:
        ``{case name: path}``, sorted by case name.

    Raises:
        ValueError: Naming the entry, for any other visible entry (a ``.png``, a DICOM series' folder...) and for
            two files of one case (``a.nii`` and ``a.nii.gz``).
    """
    found: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        if path.name.startswith("."):
            continue
        name = case_name(path) if path.is_file() else None
        if name is None:
            kind = "folder" if path.is_dir() else "file"
            raise ValueError(
                f"site {site!r}: {path} is not a NIfTI volume (a {kind}; only .nii and .nii.gz files may be in "
                f"{directory}; DICOM series are not read: convert them first, e.g. with dcm2niix)"
            )
        if name in found:
            raise ValueError(f"site {site!r}: case {name!r} has two files, {found[name]} and {path}")
        found[name] = path
    return dict(sorted(found.items()))


def pair_cases(images_dir: Path, labels_dir: Path, site: str) -> list[Case]:
    """Pairs ``images/<case>.nii[.gz]`` with ``labels/<case>.nii[.gz]`` by case name.

    Args:
        images_dir: The site's ``images/`` folder.
        labels_dir: The site's ``labels/`` folder.
        site: The site's name.

    Returns:
        One :class:`Case` per case, sorted by case name.

    Raises:
        ValueError: Naming the site and folder or file: a missing folder, no volumes, a non-NIfTI entry, an image
            without a label or a label without an image.
    """
    for d in (images_dir, labels_dir):
        if not d.is_dir():
            raise ValueError(f"site {site!r}: missing folder {d} (expected images/ and labels/ of NIfTI volumes)")
    images, labels = nifti_files(images_dir, site), nifti_files(labels_dir, site)
    if not images and not labels:
        raise ValueError(f"site {site!r} is empty: no .nii/.nii.gz volumes in {images_dir}")
    for name, path in images.items():
        if name not in labels:
            raise ValueError(f"site {site!r}: image {path} has no label {labels_dir / (name + '.nii.gz')}")
    for name, path in labels.items():
        if name not in images:
            raise ValueError(f"site {site!r}: label {path} has no image in {images_dir}")
    return [Case(site, name, images[name], labels[name]) for name in images]


def read_index_csv(path: Path) -> list[Case]:
    """Reads a CSV index: columns ``image``, ``label``, ``site`` and optionally ``case`` and ``split``.

    Paths are relative to the CSV's folder, or absolute. Other columns are ignored.

    Args:
        path: The CSV file.

    Returns:
        One :class:`Case` per row, in file order.

    Raises:
        FileNotFoundError: If the CSV, or a volume it names, does not exist (naming it and the row).
        ValueError: Naming the CSV and row: a missing column, an empty cell, a ``split`` other than train/test/val,
            an image listed twice, or one case given both splits.
    """
    if not path.is_file():
        raise FileNotFoundError(f"index CSV not found: {path}")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in _CSV_COLUMNS if c not in columns]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (has: {', '.join(columns) or 'none'})")
        rows = [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in reader]
    if not rows:
        raise ValueError(f"{path} lists no volumes")
    has_split = "split" in columns
    cases, seen, case_split = [], {}, {}
    for line, row in enumerate(rows, start=2):  # line 1 is the header
        where = f"{path} line {line}"
        for column in (*_CSV_COLUMNS, *(("split",) if has_split else ())):
            if not row.get(column):
                raise ValueError(f"{where}: empty {column!r}")
        split = row["split"].lower() if has_split else None
        if split is not None and split not in _SPLITS:
            raise ValueError(f"{where}: split must be 'train', 'val' or 'test', got {row['split']!r}")
        files = []
        for column in ("image", "label"):
            file = Path(row[column])
            file = file if file.is_absolute() else path.parent / file
            if not file.is_file():
                raise FileNotFoundError(f"{where}: {column} {file} not found")
            files.append(file)
        image = files[0].resolve()
        if image in seen:
            raise ValueError(f"{where}: image {files[0]} is already listed on line {seen[image]}")
        seen[image] = line
        case = Case(row["site"], row.get("case") or row["image"], files[0], files[1], split)
        key = (case.site, case.case)
        if split is not None and case_split.setdefault(key, split) != split:
            raise ValueError(f"{where}: case {case.case!r} of site {case.site!r} is in both train and test")
        cases.append(case)
    return cases


def split_cases(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits ``n`` cases into train and test positions, seeded: whole cases, never slices.

    The test set gets ``round(n * test_fraction)`` cases, at least one when ``test_fraction > 0`` and ``n >= 2``,
    and at most ``n - 1`` (every client keeps a training case).

    Args:
        n: Number of cases.
        test_fraction: Fraction of cases held out, in [0, 1).
        val_fraction: Fraction of each client's training samples held out as its validation set
            (default 0: none; see :class:`~datamodules.base.FederatedDataModule`).
        seed: Seed of the choice.

    Returns:
        ``(train, test)``: sorted int64 positions in ``range(n)``, disjoint, together all of them.
    """
    n_test = int(np.floor(n * test_fraction + 0.5))
    if test_fraction > 0 and n >= 2:
        n_test = max(n_test, 1)
    n_test = min(n_test, max(n - 1, 0))
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_test:]).astype(np.int64), np.sort(order[:n_test]).astype(np.int64)


def assign_clients(n: int, clients: int, seed: int) -> list[np.ndarray]:
    """Deals ``n`` cases out to ``clients`` clients of near-equal size, seeded (patient-level).

    Args:
        n: Number of cases (>= ``clients``).
        clients: Number of clients.
        seed: Seed of the shuffle.

    Returns:
        One sorted int64 array of case positions per client; sizes differ by at most one.
    """
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(part).astype(np.int64) for part in np.array_split(order, clients)]


class NiftiSegFederated(FederatedDataModule):
    """NIfTI image/label volumes per site, sliced to 2D slices for segmentation; one client per site.

    Two ways to name the volumes:

    - a folder per site: ``root/<site>/images/<case>.nii.gz`` with ``root/<site>/labels/<case>.nii.gz`` (same case
      names; ``.nii`` too). Sites are the folders' names (sorted; hidden ones and plain files in ``root`` are
      ignored). Hidden files in ``images/``/``labels/`` (``.DS_Store``) are skipped; any other file or folder that
      is not ``.nii``/``.nii.gz`` is refused, naming it.
    - ``index_csv``: a CSV with columns ``image``, ``label``, ``site`` (paths relative to the CSV's folder, or
      absolute), optionally ``case`` (rows with the same case id in a site are one patient; default: each row is
      its own case) and ``split`` (``train``/``test``/``val``: the split is then taken from it, ``val`` rows being the
      official validation split, and ``test_fraction`` is
      not used).

    Each site is one client whose id is the site's name, or, with ``clients_per_site=k > 1``, ``k`` clients
    ``<site>_0`` ... ``<site>_<k-1>`` holding a seeded, near-equal share of the site's cases. A client's cases are
    split into train and test **by case** (a patient's slices are never in both): ``test_fraction`` of them, at
    least one case when the client has two or more and ``test_fraction > 0``, seeded.

    Each volume is normalised (``normalize``, statistics of the whole volume), sliced along ``axis`` (the voxel
    array as stored: no reorientation; slices of the other two axes in order), the slices kept by ``slices`` and
    ``every_k``, then resized to ``image_size`` x ``image_size`` (bilinear for images, nearest for labels; a
    non-square slice is stretched). Images are float (N, 1, H, W) in [0, 1] (one channel: MRI), masks int64 class
    ids. Every slice's ``train_domain``/``test_domain`` is its site's index (sorted sites), so figures show sites.

    Checked at the first load, each error naming the file (and site): an image without a label or a label without
    an image; a site folder without volumes; a non-NIfTI entry; an unreadable file; a volume that is not 3D; NaN
    voxels; an image and label of different shapes or affines (``numpy.allclose(atol=1e-3)`` on the 4x4 affine); a
    label value that is not a class; a client left with no training slices, or with no test slices (unless
    ``test_fraction`` is 0 without a ``split`` column). DICOM series are not read: convert them to NIfTI first (e.g.
    with ``dcm2niix``).

    Args:
        root: The folder of site folders (give this or ``index_csv``).
        index_csv: A CSV index of the volumes (give this or ``root``).
        axis: Axis of the voxel array along which volumes are sliced: 0, 1 or 2.
        slices: ``"foreground"``: keep only the slices whose label has a non-background voxel (after
            ``label_map``); ``"all"``: keep every slice.
        every_k: Keep every k-th of those slices (1: all of them), starting with the first.
        normalize: Per-volume intensity normalisation onto [0, 1]: ``"minmax"`` (``(x - min)/(max - min)``),
            ``"zscore"`` (``z = (x - mean)/std`` clipped to [-3, 3], then ``(z + 3)/6``) or ``"percentile"``
            (clipped to the volume's 0.5th and 99.5th percentiles, then min-max over that range).
        image_size: Side to which every slice is resized.
        num_classes: Classes including background (0); label values must be ``0 .. num_classes - 1`` (or are
            mapped by ``label_map``).
        label_map: Raw label value -> class id (e.g. ``{0: 0, 1: 1, 2: 1}`` to merge two zones into one class);
            every value in a label volume must be a key. None: values are class ids as they are.
        clients_per_site: Clients each site's cases are dealt to (seeded, by case).
        batch_size: Training batch size.
        eval_batch_size: Batch size of the test loaders.
        test_fraction: Fraction of each client's cases held out as its test set (ignored with a ``split`` column).
        seed: Seed for the case-to-client deal, the train/test split and shuffling.

    Raises:
        ValueError: On an invalid argument, naming it. Data errors are raised at the first load and name the file.
        FileNotFoundError: At the first load, if ``root``, ``index_csv`` or a volume the CSV names is missing.

    """

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        index_csv: str | Path | None = None,
        axis: int = 2,
        slices: SliceMode = "foreground",
        every_k: int = 1,
        normalize: NormalizeMode = "percentile",
        image_size: int = 64,
        num_classes: int = 2,
        label_map: dict[int, int] | None = None,
        clients_per_site: int = 1,
        batch_size: int = 16,
        eval_batch_size: int = 64,
        test_fraction: float = 0.2,
        val_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            test_fraction=test_fraction,
            seed=seed,
            val_fraction=val_fraction,
        )
        if (root is None) == (index_csv is None):
            raise ValueError("give exactly one of root (a folder per site) and index_csv (a CSV index)")
        check_image_args(image_size, 1)
        if axis not in (0, 1, 2):
            raise ValueError(f"axis must be 0, 1 or 2, got {axis}")
        if slices not in _SLICE_MODES:
            raise ValueError(f"slices must be one of {', '.join(_SLICE_MODES)}, got {slices!r}")
        if every_k < 1:
            raise ValueError(f"every_k must be >= 1, got {every_k}")
        if normalize not in NORMALIZE_MODES:
            raise ValueError(f"normalize must be one of {', '.join(NORMALIZE_MODES)}, got {normalize!r}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2 (background + a class), got {num_classes}")
        if clients_per_site < 1:
            raise ValueError(f"clients_per_site must be >= 1, got {clients_per_site}")
        if label_map is not None:
            if not label_map:
                raise ValueError("label_map must map at least one label value, or be None")
            label_map = {int(k): int(v) for k, v in label_map.items()}
            bad = {k: v for k, v in label_map.items() if not 0 <= v < num_classes}
            if bad:
                raise ValueError(f"label_map maps to classes outside [0, {num_classes}): {bad}")
        self.root = Path(root) if root is not None else None
        self.index_csv = Path(index_csv) if index_csv is not None else None
        self.axis = axis
        self.slices = slices
        self.every_k = every_k
        self.normalize = normalize
        self.size = image_size
        self.label_map = label_map
        self.clients_per_site = clients_per_site
        self._num_classes_arg = num_classes
        self._declared_num_classes = num_classes
        self._source = str(self.root if self.root is not None else self.index_csv)
        self._sites: list[str] = []
        self._client_site: dict[str, str] = {}
        self._slice_sources: dict[str, dict[str, list[tuple[str, int]]]] = {}

    # ------------------------------------------------------------------------------------------- the cases

    def _cases(self) -> list[Case]:
        if self.index_csv is not None:
            return read_index_csv(self.index_csv)
        assert self.root is not None
        if not self.root.is_dir():
            raise FileNotFoundError(f"NIfTI root folder not found: {self.root}")
        site_dirs = _visible_dirs(self.root)
        if not site_dirs:
            raise ValueError(f"no site folders in {self.root}; expected root/<site>/images and root/<site>/labels")
        return [c for d in site_dirs for c in pair_cases(d / "images", d / "labels", d.name)]

    def _volume_slices(self, case: Case) -> tuple[Tensor, Tensor, np.ndarray]:
        """One case's kept slices: images (n, 1, S, S), masks (n, S, S) and their indices along ``axis``."""
        image, image_affine = read_volume(case.image)
        raw_label, label_affine = read_volume(case.label)
        check_pair(case.image, image.shape, image_affine, case.label, raw_label.shape, label_affine)
        label = map_labels(raw_label, self._num_classes_arg, self.label_map, case.label)
        keep = select_slices(label, self.axis, self.slices, self.every_k)
        x = torch.from_numpy(take_slices(normalize_volume(image, self.normalize), self.axis, keep).copy())
        y = torch.from_numpy(take_slices(label, self.axis, keep).copy())
        x, y = resize_slices(x, y, self.size)
        return x, y, keep

    def _client_cases(self, cases: list[Case]) -> list[tuple[str, str, dict[str, list[Case]]]]:
        """``(client id, site, {"train": cases, "test": cases})`` per client, in site then client order."""
        by_site: dict[str, dict[str, list[Case]]] = {}
        for c in cases:
            by_site.setdefault(c.site, {}).setdefault(c.case, []).append(c)
        self._sites = sorted(by_site)
        has_split = any(c.split is not None for c in cases)
        out = []
        for site in self._sites:
            patients = sorted(by_site[site])
            if len(patients) < self.clients_per_site:
                raise ValueError(
                    f"site {site!r} has {len(patients)} case(s), fewer than clients_per_site={self.clients_per_site} "
                    f"({self._source})"
                )
            parts = assign_clients(len(patients), self.clients_per_site, stable_seed(self.seed, "clients", site))
            for i, part in enumerate(parts):
                client = site if self.clients_per_site == 1 else f"{site}_{i}"
                names = [patients[j] for j in part]
                if has_split:
                    split = {s: [c for n in names for c in by_site[site][n] if c.split == s] for s in _SPLITS}
                else:
                    train, test = split_cases(len(names), self.test_fraction, stable_seed(self.seed, "split", client))
                    split = {
                        "train": [c for j in train for c in by_site[site][names[j]]],
                        "test": [c for j in test for c in by_site[site][names[j]]],
                        "val": [],
                    }
                out.append((client, site, split))
        return out

    # ----------------------------------------------------------------------------------------------- load

    def _load(self) -> list[ClientSplit]:
        cases = self._cases()
        has_split = any(c.split is not None for c in cases)
        need_test = has_split or self.test_fraction > 0
        splits = []
        self._client_site, self._slice_sources = {}, {}
        for client, site, parts in self._client_cases(cases):
            site_index = self._sites.index(site)
            tensors: dict[str, tuple[Tensor, Tensor]] = {}
            sources: dict[str, list[tuple[str, int]]] = {}
            for name in _SPLITS:
                xs, ys, src = [], [], []
                for case in parts[name]:
                    x, y, keep = self._volume_slices(case)
                    xs.append(x)
                    ys.append(y)
                    src += [(case.case, int(k)) for k in keep]
                s = self.size
                x_all = torch.cat(xs) if xs else torch.empty(0, 1, s, s)
                y_all = torch.cat(ys) if ys else torch.empty(0, s, s, dtype=torch.int64)
                where = f"{'site' if client == site else 'client'} {client!r} ({self._source})"
                if not len(x_all) and (name == "train" or (name == "test" and need_test)):
                    if not parts[name]:
                        reason = (
                            "its split column puts no case in it"
                            if has_split
                            else "it has a single case (add cases or set test_fraction=0)"
                        )
                    else:
                        reason = (
                            f"its {len(parts[name])} case(s) have no {self.slices} slices ("
                            + ", ".join(str(c.label) for c in parts[name])
                            + ")"
                        )
                    raise ValueError(f"{where} has no {name} slices: {reason}")
                tensors[name] = (x_all, y_all)
                sources[name] = src
            (train_x, train_y), (test_x, test_y) = tensors["train"], tensors["test"]
            # a case is a patient: a carved validation split takes whole cases (datamodules.validation)
            case_ids = {name: i for i, name in enumerate(dict.fromkeys(name for name, _ in sources["train"]))}
            official = parts.get("val")  # the split column's val rows, if it has any
            splits.append(
                ClientSplit(
                    client,
                    train_x,
                    train_y,
                    test_x,
                    test_y,
                    train_domain=torch.full((len(train_y),), site_index, dtype=torch.int64),
                    test_domain=torch.full((len(test_y),), site_index, dtype=torch.int64),
                    val_x=tensors["val"][0] if official else None,
                    val_y=tensors["val"][1] if official else None,
                    val_domain=torch.full((len(tensors["val"][1]),), site_index, dtype=torch.int64)
                    if official
                    else None,
                    train_case=torch.tensor([case_ids[name] for name, _ in sources["train"]], dtype=torch.int64),
                )
            )
            self._client_site[client] = site
            self._slice_sources[client] = sources
        return splits

    # ---------------------------------------------------------------------------------------- descriptions

    @property
    def sites(self) -> list[str]:
        """The sites, sorted; a slice's domain id is its site's position here (the first access loads the data)."""
        self._ensure_loaded()
        return list(self._sites)

    def site_of(self, client_id: str) -> str:
        """The site a client's cases come from.

        Args:
            client_id: One of :attr:`client_ids`.

        Returns:
            The site's name.

        Raises:
            KeyError: If the client id is unknown.
        """
        self.client_data(client_id)
        return self._client_site[client_id]

    def slice_sources(self, client_id: str, split: str = "train") -> list[tuple[str, int]]:
        """Where each of a client's slices comes from: ``(case, slice index along axis)``, in the tensors' order.

        Args:
            client_id: One of :attr:`client_ids`.
            split: ``"train"``, ``"test"`` or ``"val"`` (the train slices as read, before a carved validation split).

        Returns:
            One ``(case id, index)`` per slice of the split.

        Raises:
            KeyError: If the client id is unknown.
            ValueError: If ``split`` is not ``"train"``, ``"test"`` or ``"val"``.
        """
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train', 'test' or 'val', got {split!r}")
        self.client_data(client_id)
        return list(self._slice_sources[client_id][split])

    @override
    def image_sources(self, client_id: str) -> tuple[list[str], str] | None:
        """The site of each training slice, for ``sites.png``; None where the client id is the site's name."""
        site = self.site_of(client_id)
        return None if site == client_id else ([site] * self.num_train_samples(client_id), "sites")
