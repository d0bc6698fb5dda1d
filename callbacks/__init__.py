"""Federation mechanisms, one per file; add them to ``trainer.callbacks`` in a config."""

from callbacks.amplitude_norm import AmplitudeNormalization
from callbacks.base import FederatedCallback
from callbacks.classifier_shift import ClassifierShift
from callbacks.clustered_fl import ClusteredFL
from callbacks.ddi.domain_isolation import DomainIsolation
from callbacks.dp_fedavg import DPFedAvg
from callbacks.dp_sgd import DPSGD
from callbacks.fedbn import FedBN
from callbacks.feddyn import FedDyn
from callbacks.feder.experience_replay import ExperienceReplay
from callbacks.fednova import FedNova
from callbacks.fedopt import FedOpt
from callbacks.fedprox import FedProx
from callbacks.head_body.fedala import FedALA
from callbacks.head_body.fedbabu import FedBABU
from callbacks.head_body.fedper import FedPer
from callbacks.head_body.fedrep import FedRep
from callbacks.head_body.lg_fedavg import LGFedAvg
from callbacks.local_fine_tuning import LocalFineTuning
from callbacks.lr_schedule import LRSchedule
from callbacks.moon import Moon
from callbacks.personal.apfl import APFL
from callbacks.personal.ditto import Ditto
from callbacks.personal.mr_mtl import MRMTL
from callbacks.reweighting import Reweighting
from callbacks.scaffold import Scaffold
from callbacks.secure_aggregation import SecureAggregation
from callbacks.weight_perturbation import WeightPerturbation

__all__ = [
    "APFL",
    "AmplitudeNormalization",
    "ClassifierShift",
    "ExperienceReplay",
    "ClusteredFL",
    "DPFedAvg",
    "DomainIsolation",
    "DPSGD",
    "Ditto",
    "FedALA",
    "FedBABU",
    "FedBN",
    "FedDyn",
    "FedNova",
    "FedOpt",
    "FedPer",
    "FedRep",
    "FedProx",
    "FederatedCallback",
    "LGFedAvg",
    "LRSchedule",
    "LocalFineTuning",
    "MRMTL",
    "Moon",
    "Reweighting",
    "Scaffold",
    "SecureAggregation",
    "WeightPerturbation",
]
