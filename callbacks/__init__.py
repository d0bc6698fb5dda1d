"""Federation mechanisms, one per file; add them to ``trainer.callbacks`` in a config."""

from callbacks.base import FederatedCallback
from callbacks.fedbn import FedBN
from callbacks.fedprox import FedProx

__all__ = ["FedBN", "FedProx", "FederatedCallback"]
