"""Pure functions for the federated math; no Trainer, no callbacks, easy to test on tiny tensors."""

from fl_lightning.ops.aggregate import RunningWeightedMean, aggregation_weights, weighted_average
from fl_lightning.ops.proximal import add_proximal_gradient
from fl_lightning.ops.state import clone_state, select_keys

__all__ = [
    "RunningWeightedMean",
    "add_proximal_gradient",
    "aggregation_weights",
    "clone_state",
    "select_keys",
    "weighted_average",
]
