"""What a run needs recorded to be reproduced: versions, git commit, seed, command line."""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "torchvision", "lightning", "torchmetrics", "numpy", "scikit-learn", "jsonargparse", "wandb")
IMPORT_NAMES = {"scikit-learn": "sklearn"}


def git_commit(directory: Path) -> str | None:
    """The commit checked out in ``directory`` (with ``-dirty`` if there are local changes), or None."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def environment_record(seed: int) -> dict[str, Any]:
    """Python, platform, package versions, the project's git commit, the seed and the command line."""
    versions = {}
    for name in PACKAGES:
        # The imported module's own version when loaded: the wheel metadata lacks build tags such as "+cu130".
        imported = getattr(sys.modules.get(IMPORT_NAMES.get(name, name)), "__version__", None)
        try:
            versions[name] = str(imported) if imported else metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "git_commit": git_commit(Path(__file__).resolve().parent.parent),
        "seed": seed,
        "argv": sys.argv,
    }
