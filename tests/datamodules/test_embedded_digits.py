"""The embedded digits read from scikit-learn's file equal ``sklearn.datasets.load_digits``, without importing it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits as load_with_sklearn

from datamodules import embedded_digits
from datamodules.embedded_digits import load_digits

ROOT = Path(__file__).resolve().parents[2]


def test_the_digits_equal_scikit_learns():
    images, labels = load_digits()
    reference = load_with_sklearn()
    assert images.shape == (1797, 8, 8) and labels.dtype == np.int64
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)


def test_reading_the_digits_does_not_import_scikit_learn():
    probe = (
        "import sys; from datamodules.embedded_digits import load_digits; images, labels = load_digits(); "
        "assert len(labels) == 1797; assert 'sklearn' not in sys.modules, 'sklearn imported'"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)


def test_without_the_file_scikit_learns_loader_is_used(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(embedded_digits.Path, "is_file", lambda self: False)
    images, labels = load_digits()
    assert np.array_equal(labels, load_with_sklearn().target) and images.shape == (1797, 8, 8)
