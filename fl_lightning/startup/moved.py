"""Module paths from before the layout steps, still importable, so saved configs and old scripts keep working.

A run directory's ``config.yaml`` names classes by module path (e.g. FedER's ``fl_lightning.models.gan``); those
modules moved beside their method or to the side of the boundary they belong to, and the commands moved to
``fl_lightning/tools/``. :func:`install` lets an import of an old path load the new module (with a
``DeprecationWarning`` naming it and the release that removes the old path, :data:`REMOVED_IN`), ``python -m``
with an old command's path run the moved command (with a ``FutureWarning``, which Python shows by default), and
:func:`canonical_class_path` lets a resume compare a saved class path with today's (both as where the class is
defined).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType

#: The fl_lightning release that removes the old paths below (they are deprecated since 0.1.0).
REMOVED_IN = "0.3.0"

_OUTPUTS = "run_dir records report tracking plots collapse checkpoint resume config_diff client_store environment"
_TOOLS = "compare membership_audit wandb_sync config_reference"
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
    **{f"fl_lightning.{m}": f"fl_lightning.tools.{m}" for m in _TOOLS.split()},
    **{f"fl_lightning.compare.{m}": f"fl_lightning.tools.compare.{m}" for m in ("cli", "figure", "runs", "table")},
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
        if fullname not in MOVED:
            return None
        target = importlib.util.find_spec(MOVED[fullname])  # its file: what ``python -m`` puts in sys.argv[0]
        return importlib.util.spec_from_loader(fullname, self, origin=target.origin if target else None)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {MOVED[spec.name]}; import it from there (the old path goes in {REMOVED_IN})",
            DeprecationWarning,
            2,
        )
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the moved module is already executed

    def get_code(self, fullname: str) -> CodeType | None:
        """What ``python -m <old path>`` runs: the moved module's code (a package's ``__main__``), with a warning."""
        target = MOVED[fullname]
        spec = importlib.util.find_spec(target)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{target}.__main__")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            return None
        warnings.warn(
            f"python -m {fullname} is now python -m {target}; the old command goes in {REMOVED_IN}", FutureWarning, 2
        )
        return spec.loader.get_code(spec.name)


def install() -> None:
    """Make the old module paths importable (once per process).

    First among the finders: a submodule of a moved package (``fl_lightning.compare.cli``) would otherwise be
    found again in the package's folder and loaded a second time under its old name.
    """
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
