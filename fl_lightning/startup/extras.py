"""The optional extras, and a check, before the config is parsed, that the packages it names are installed.

Without it, a recipe whose network is ``monai.networks.nets.DenseNet121`` on an install without the ``medical``
extra ends in jsonargparse's 60-line dump of every union subtype with "No module named 'monai'" buried inside.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

# The top-level modules of the optional extras (pyproject.toml's [project.optional-dependencies]).
EXTRAS = {"monai": "medical", "nibabel": "medical", "flwr": "flower", "ray": "flower-sim"}
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.\w+)+")


def install_hint(module: str) -> str:
    """``install the <extra> extra: pip install -e '.[<extra>]'`` for a module of an extra."""
    extra = EXTRAS[module]
    return f"install the {extra} extra: pip install -e '.[{extra}]'"


def missing_extra(argv: list[str]) -> str | None:
    """One line naming the first class path of ``argv`` (its config files included) whose extra is not installed.

    Class paths are read from every ``class_path`` of the ``--config`` files (and the files they include with
    ``config:``) and from any command-line value that is a dotted name (``--model.net=monai.networks.nets.UNet``).
    Only modules of an extra are looked for; any other missing module is left to the parser's own error.
    """
    for where, path in _class_paths(argv):
        top = path.split(".")[0]
        if top in EXTRAS and importlib.util.find_spec(top) is None:
            return f"{where}: {path} needs the {top!r} package, which is not installed: {install_hint(top)}"
    return None


def _class_paths(argv: list[str]) -> Iterator[tuple[str, str]]:
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key == "--config":
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            yield from _in_config(Path(value), set())
        elif eq and key.startswith("--") and _DOTTED.fullmatch(value):
            yield f"the command line ({key})", value


def _in_config(path: Path, seen: set[Path]) -> Iterator[tuple[str, str]]:
    if path in seen or not path.is_file():
        return  # the parser says what is wrong with a missing file
    seen.add(path)
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return  # likewise
    yield from _in_tree(content, path, "", seen)


def _in_tree(node: Any, path: Path, key: str, seen: set[Path]) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "class_path" and isinstance(v, str):
                yield f"{path} ({key}.class_path)".replace("(.", "("), v
            elif k == "config" and isinstance(v, str) and not key:
                yield from _in_config(path.parent / v, seen)
            else:
                yield from _in_tree(v, path, f"{key}.{k}", seen)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _in_tree(v, path, f"{key}[{i}]", seen)
