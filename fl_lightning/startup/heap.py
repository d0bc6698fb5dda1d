"""Keep Python's cyclic collector off what a process imports and builds once and keeps until it exits."""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def long_lived() -> Iterator[None]:
    """No cyclic collection inside the block; afterwards everything alive is frozen out of the collector's way.

    For what a process builds once and keeps until it exits (importing Lightning and torch, building a CLI, data
    and a Trainer): frozen objects are left out of every later collection. Objects created after the block are
    collected as usual; the collector is on again unless it was off before.
    """
    # Why: those imports create many objects that live as long as the process; the collector would traverse them
    # while they are imported, at every later full collection and at exit.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def import_long_lived(*modules: str) -> None:
    """Import ``modules`` (and whatever they import) inside :func:`long_lived`: for a process that keeps them."""
    with long_lived():
        for name in modules:
            importlib.import_module(name)
