"""Federated datamodules: per-client data, seeded partitioners, per-site imaging styles and samplers."""

from datamodules.base import ClientSplit, FederatedDataModule
from datamodules.clinical_table import ClinicalTableFederated
from datamodules.digits import DigitsFederated
from datamodules.digits_seg import DigitsSegFederated
from datamodules.image_folder import ImageFolderFederated
from datamodules.medmnist import MedMNISTFederated
from datamodules.nifti import NiftiSegFederated
from datamodules.partition import (
    PARTITION_SCHEMES,
    partition,
    partition_by_domain,
    partition_dirichlet,
    partition_dirichlet_domains,
    partition_iid,
    partition_pathological,
)
from datamodules.sampler import SeededEpochSampler, stable_seed
from datamodules.seg_folder import SegFolderFederated
from datamodules.shifts import SiteStyle, apply_style, default_site_styles
from datamodules.site_table import SiteTableFederated
from datamodules.split import split_train_test
from datamodules.survival_synthetic import SyntheticSurvivalFederated
from datamodules.synthetic import SyntheticFederated

__all__ = [
    "SyntheticSurvivalFederated",
    "ClinicalTableFederated",
    "PARTITION_SCHEMES",
    "ClientSplit",
    "DigitsFederated",
    "DigitsSegFederated",
    "FederatedDataModule",
    "ImageFolderFederated",
    "MedMNISTFederated",
    "NiftiSegFederated",
    "SeededEpochSampler",
    "SegFolderFederated",
    "SiteStyle",
    "SiteTableFederated",
    "SyntheticFederated",
    "apply_style",
    "default_site_styles",
    "partition",
    "partition_by_domain",
    "partition_dirichlet",
    "partition_dirichlet_domains",
    "partition_iid",
    "partition_pathological",
    "split_train_test",
    "stable_seed",
]
