"""Module paths from before the layout step, still importable, so saved configs and old scripts keep working.

A run directory's ``config.yaml`` names classes by module path (e.g. FedER's ``fl_lightning.models.gan``); those
modules moved beside their method or to the side of the boundary they belong to. :func:`install` lets an import of
an old path load the new module (with a ``DeprecationWarning`` naming it), and :func:`canonical_class_path` lets a
resume compare a saved class path with today's (both as where the class is defined).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType

_OUTPUTS = "run_dir records report tracking plots collapse checkpoint resume config_diff client_store environment"
MOVED: dict[str, str] = {
    "fl_lightning.protocol": "fl_lightning.wire.protocol",
    "fl_lightning.transport": "fl_lightning.wire.transport",
    "fl_lightning.federation": "fl_lightning.server.federation",
    "fl_lightning.selection": "fl_lightning.server.selection",
    "fl_lightning.groups": "fl_lightning.server.groups",
    "fl_lightning.evaluation": "fl_lightning.server.evaluation",
    "fl_lightning.directory": "fl_lightning.server.directory",
    "fl_lightning.local_fit": "fl_lightning.runtime.local_fit",
    "fl_lightning.heap": "fl_lightning.startup.heap",
    "fl_lightning.lean_imports": "fl_lightning.startup.lean_imports",
    "fl_lightning.metrics": "fl_lightning.clients.metrics",
    "fl_lightning.segmentation_metrics": "fl_lightning.clients.segmentation_metrics",
    "fl_lightning.private_gan": "callbacks.feder.private_gan",
    "fl_lightning.replay": "callbacks.feder.replay",
    "fl_lightning.generator_store": "callbacks.feder.generator_store",
    "fl_lightning.models.gan": "callbacks.feder.gan",
    "fl_lightning.models.perceptual": "callbacks.feder.perceptual",
    "fl_lightning.ddi_plots": "callbacks.ddi.plots",
    "callbacks.experience_replay": "callbacks.feder.experience_replay",
    "callbacks.privacy_audit": "callbacks.feder.privacy_audit",
    "callbacks.domain_isolation": "callbacks.ddi.domain_isolation",
    "callbacks.cluster_selector": "callbacks.ddi.cluster_selector",
    **{f"fl_lightning.{m}": f"fl_lightning.outputs.{m}" for m in _OUTPUTS.split()},
}


@functools.cache
def canonical_class_path(path: str) -> str:
    """Where the class ``path`` names is defined today.

    ``callbacks.ExperienceReplay`` and the pre-move ``callbacks.experience_replay.ExperienceReplay`` are both
    ``callbacks.feder.experience_replay.ExperienceReplay``.

    A path that does not import stays as it is, with a moved module replaced (the comparison then shows it).
    """
    module, _, name = path.rpartition(".")
    module = MOVED.get(module, module)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return f"{module}.{name}" if module else path
    return f"{obj.__module__}.{obj.__qualname__}" if hasattr(obj, "__qualname__") else f"{module}.{name}"


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module it moved to (the same module object under both names)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there", DeprecationWarning, 2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the moved module is already executed


def install() -> None:
    """Make the old module paths importable (once per process; after the regular finders, which fail on them)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
