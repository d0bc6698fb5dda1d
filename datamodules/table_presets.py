"""Named settings of :class:`~datamodules.clinical_table.ClinicalTableFederated` for published benchmarks' tables."""

from __future__ import annotations

from typing import Any

# UCI Heart Disease's 14 processed attributes (heart-disease.names, "only 14 used"), in file order.
UCI_HEART_COLUMNS = [
    "age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalach", "exang", "oldpeak", "slope", "ca", "thal",
    "num",
]  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    # FLamby's Fed-Heart-Disease (flamby/datasets/fed_heart_disease/dataset.py): the four UCI centres' processed
    # files; columns 10-12 (slope, ca, thal) and rows with "?" dropped; cp and restecg one-hot with the first
    # category dropped; label num > 0; each centre split 0.66 / 0.34 by scikit-learn, stratified, random_state 43;
    # features standardised with their centre's training mean and unbiased std (+ 1e-9); batch size 4.
    "flamby_heart": {
        "files": [
            "processed.cleveland.data",
            "processed.hungarian.data",
            "processed.switzerland.data",
            "processed.va.data",
        ],
        "site_pattern": r"processed\.(?P<site>[^.]+)\.data",
        "header": False,
        "columns": UCI_HEART_COLUMNS,
        "drop_columns": ["slope", "ca", "thal"],
        "categorical_columns": ["cp", "restecg"],
        "label_column": "num",
        "label_threshold": 0.0,
        "missing": "drop",
        "missing_values": ["?"],
        "standardize": "site",
        "split_random_state": 43,
    },
}

# Settings a preset expects but does not set: the base class's own arguments, which keep their defaults (a config
# changing the data class keeps the previous class's values of these, so a preset could not tell them from the
# user's); a value that differs is warned about.
EXPECTED: dict[str, dict[str, Any]] = {"flamby_heart": {"test_fraction": 0.34, "batch_size": 4}}

# What every argument left at None means without a preset.
DEFAULTS: dict[str, Any] = {
    "files": ["*.csv"],
    "site_pattern": None,
    "header": True,
    "columns": None,
    "delimiter": None,
    "drop_columns": [],
    "categorical_columns": [],
    "drop_first": True,
    "label_column": "label",
    "label_threshold": None,
    "missing": "error",
    "missing_values": ["NA", "NaN", "nan", "?"],
    "standardize": "site",
    "std_eps": 1e-9,
    "split_random_state": None,
}


def resolve(preset: str | None, given: dict[str, Any]) -> dict[str, Any]:
    """Every setting: what the config gave, else the preset's, else :data:`DEFAULTS`.

    Raises:
        ValueError: On an unknown preset, listing the known ones.
    """
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"data.init_args.preset={preset!r} is not a known preset; known: {', '.join(PRESETS)}")
    chosen = PRESETS.get(preset or "", {})
    return {k: given[k] if given.get(k) is not None else chosen.get(k, DEFAULTS.get(k)) for k in {*DEFAULTS, *given}}


def differences(preset: str | None, given: dict[str, Any]) -> list[str]:
    """The ``key=value`` settings that differ from what ``preset`` expects (:data:`EXPECTED`), as warning text."""
    expected = EXPECTED.get(preset or "", {})
    return [
        f"data.init_args.{k}={given[k]!r} (preset {preset} expects {v!r})" for k, v in expected.items() if given[k] != v
    ]
