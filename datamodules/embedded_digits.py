"""scikit-learn's embedded handwritten digits, read from its data file without importing scikit-learn."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8×8 digit scans (values 0–16, float64) and their labels (int64), as scikit-learn's ``load_digits``.

    Read straight from ``sklearn/datasets/data/digits.csv.gz`` (what ``sklearn.datasets.load_digits`` reads),
    without importing scikit-learn. Falls back to scikit-learn's loader if the file is not where scikit-learn
    keeps it.

    Raises:
        ModuleNotFoundError: If scikit-learn is not installed (the data come with it).
    """
    # Why not import scikit-learn: it would add to the start-up of every run and of every Flower site.
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the embedded digits come with scikit-learn: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        data = np.loadtxt(path, delimiter=",")
        return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as load_with_sklearn

    digits = load_with_sklearn()
    return digits.images, np.asarray(digits.target, dtype=np.int64)
