"""The base class of every federation mechanism lives in the core (:mod:`fl_lightning.callback`); re-exported here."""

from fl_lightning.callback import COMPOSABLE_SERVER_STEPS, FederatedCallback, check_composition

__all__ = ["COMPOSABLE_SERVER_STEPS", "FederatedCallback", "check_composition"]
