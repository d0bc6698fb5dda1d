"""Import torchmetrics, which every Lightning import pulls in, without the ``scipy.signal`` that no run uses.

``import lightning`` imports torchmetrics in full (``lightning.fabric.utilities.imports`` imports the package to
read its version), and torchmetrics 1.x imports ``scipy.signal`` while it loads, only to alias
``scipy.signal.hamming`` for SRMRpy, a package torchmetrics itself never imports.

The ``fl_lightning`` package calls :func:`install` when it is imported, so every entry point that imports one of
our modules before Lightning (``train.py``, the Flower apps, the torchrun ranks) gets it; a script that imports
Lightning first just loads ``scipy.signal`` as usual. The first import of torchmetrics then runs with a placeholder
``scipy.signal`` module that already has ``hamming``; when torchmetrics has loaded, the placeholder is gone from
``sys.modules`` and from the ``scipy`` package, so the first real ``import scipy.signal`` (ours, scikit-learn's, a
torchmetrics audio metric's) loads SciPy's module as usual. Should a torchmetrics version use anything else of
``scipy.signal`` while it loads, its import runs again with the real module (the placeholder then only cost a failed
attempt). The placeholder is process-wide while torchmetrics loads: a thread importing ``scipy.signal`` meanwhile would
get it. None of ours does (the Flower driver imports Flower's simulation and Ray in parallel with Lightning; neither
imports ``scipy.signal``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import re
import sys
import types
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

# Why: loading scipy.signal is a noticeable part of the start-up of every process that imports Lightning
# (train.py, its --help, each torchrun rank, each Flower SuperNode and Simulation Engine actor).
PACKAGE = "torchmetrics"
DEFERRED = "scipy.signal"
#: The last torchmetrics release whose package import loads ``scipy.signal`` for the SRMRpy alias (torchmetrics
#: issue #3457, open in 2026-12; 1.9.0 still has it). A later release turns the workaround off: if it still
#: imports scipy.signal, processes start slower but nothing else changes; raise this after checking it.
LAST_AFFECTED = (1, 9)


def affected(version: str) -> bool:
    """Whether a torchmetrics ``version`` (``"1.9.0"``, ``"1.10.0rc1"``) is one the workaround is for."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return found is not None and (int(found.group(1)), int(found.group(2))) <= LAST_AFFECTED


def install() -> None:
    """Defer ``scipy.signal`` past the first import of torchmetrics (once per process; a no-op afterwards).

    Nothing is installed when torchmetrics or ``scipy.signal`` is already imported, or for a torchmetrics release
    after :data:`LAST_AFFECTED` (or none installed).
    """
    if PACKAGE in sys.modules or DEFERRED in sys.modules:
        return
    try:
        if not affected(importlib.metadata.version(PACKAGE)):
            return
    except importlib.metadata.PackageNotFoundError:
        return
    if not any(isinstance(finder, _TorchmetricsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchmetricsFinder())


def _hamming(*args: Any, **kwargs: Any) -> Any:
    """What torchmetrics' alias would have pointed at, imported when called."""
    from scipy.signal import windows

    return windows.hamming(*args, **kwargs)


class _TorchmetricsFinder(importlib.abc.MetaPathFinder):
    """Finds torchmetrics with the other finders and wraps its loader; leaves ``sys.meta_path`` on first use."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PACKAGE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the finders after this one, as the import would have asked them
        if spec is not None and spec.loader is not None and DEFERRED not in sys.modules:
            spec.loader = _WithoutScipySignal(spec.loader)
        return spec


class _WithoutScipySignal(importlib.abc.Loader):
    """Runs torchmetrics' package module with a placeholder ``scipy.signal``, removed again afterwards."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        placeholder = types.ModuleType(
            DEFERRED, "placeholder while torchmetrics loads (fl_lightning.startup.lean_imports)"
        )
        placeholder.hamming = _hamming  # type: ignore[attr-defined]
        sys.modules[DEFERRED] = placeholder
        try:
            self.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - any failure under the placeholder: load it the usual way
            log.debug("torchmetrics did not load with scipy.signal deferred (%r); loading it with scipy.signal", err)
            _forget(placeholder)
            # Start again from scratch: the submodules already run saw the placeholder, and the package's namespace
            # holds them as attributes (``from torchmetrics import x`` would not import them again).
            for name in [n for n in sys.modules if n.startswith(f"{PACKAGE}.")]:
                del sys.modules[name]
            for name in [n for n in vars(module) if not (n.startswith("__") and n.endswith("__"))]:
                delattr(module, name)
            self.loader.exec_module(module)
        finally:
            _forget(placeholder)


def _forget(placeholder: types.ModuleType) -> None:
    """Remove ``placeholder`` wherever the import system may have put it."""
    if sys.modules.get(DEFERRED) is placeholder:
        del sys.modules[DEFERRED]
    scipy = sys.modules.get("scipy")
    if scipy is not None and vars(scipy).get("signal") is placeholder:
        delattr(scipy, "signal")
