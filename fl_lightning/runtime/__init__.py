"""The client side of the boundary: the runtime that hosts clients and answers tasks, and its local fits."""

from fl_lightning.runtime.client_runtime import ClientRuntime

__all__ = ["ClientRuntime"]
