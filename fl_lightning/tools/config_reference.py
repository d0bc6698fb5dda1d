"""The config reference, generated the way the CLI parses: every key with its type, default and docstring.

The ``federation:`` section and the classes that fill ``model:``, ``data:`` and ``trainer.callbacks`` are read
with jsonargparse, the library ``train.py`` parses with, from their own signatures and Google-style docstrings;
nothing here is written by hand. The docs build (``docs/hooks/generated.py``) passes every client module,
datamodule and method (the core imports none of them) and writes the reference page; :func:`undocumented` lists
keys whose docstring says nothing (a test keeps that list empty).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

from jsonargparse import ArgumentParser

from fl_lightning.config import FederationConfig


@dataclass(frozen=True)
class Entry:
    """One config key.

    Attributes:
        key: The key as a config file nests it (``federation.rounds``, ``trainer.callbacks[FedProx].mu``).
        type: Its type, as the parser checks it.
        default: Its default, as YAML would write it (``"required"`` when it has none).
        help: The docstring's text for it ("" when it has none).
    """

    key: str
    type: str
    default: str
    help: str


def _type_name(hint: Any) -> str:
    if hint is None:
        return ""
    if isinstance(hint, type):
        return hint.__name__
    text = re.sub(r"\b(typing|collections\.abc|pathlib|torch|lightning\.pytorch)\.", "", str(hint))
    text = text.replace("NoneType", "None").replace("nn.modules.module.Module", "nn.Module (a class_path)")
    union = re.fullmatch(r"(Union|Optional)\[(.*)\]", text)
    if union:  # as Python 3.10 writes it
        parts = _top_level(union.group(2))
        text = " | ".join(parts + (["None"] if union.group(1) == "Optional" else []))
    literal = re.fullmatch(r"Literal\[(.*)\]", text)
    return " | ".join(_top_level(literal.group(1))) if literal else text


def _top_level(text: str) -> list[str]:
    """``text`` split at its commas outside brackets (``dict[int, int], None`` is two parts)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


def _default(value: Any) -> str:
    if value is inspect.Parameter.empty or type(value).__name__ == "_RequiredType":
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def class_entries(cls: type, prefix: str) -> list[Entry]:
    """The keys of ``cls``'s constructor (or dataclass fields) under ``prefix``, as the CLI parses them."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "x", fail_untyped=False)
    out = []
    for action in parser._actions:  # jsonargparse exposes its parsed arguments only as argparse actions
        if not action.dest.startswith("x.") or action.default == "==SUPPRESS==":
            continue
        name = action.dest.removeprefix("x.")
        help_text = " ".join((action.help or "").split())
        if help_text.startswith(("Path to a configuration file", "show this help")):
            continue
        out.append(Entry(f"{prefix}{name}", _type_name(getattr(action, "_typehint", None)), _default(action.default),
                         help_text))  # fmt: skip
    return out


Sections = dict[str, list[tuple[str, list[Entry]]]]


def sections(models: list[type], datamodules: list[type], methods: list[type]) -> Sections:
    """Per config section, per class that may fill it, its keys (``{"data": [("DigitsFederated", [...]), ...]}``)."""
    return {
        "federation": [("FederationConfig", class_entries(FederationConfig, "federation."))],
        "model": [(c.__name__, class_entries(c, "model.init_args.")) for c in models],
        "data": [(c.__name__, class_entries(c, "data.init_args.")) for c in datamodules],
        "trainer.callbacks": [
            (c.__name__, class_entries(c, f"trainer.callbacks[{c.__name__}].init_args.")) for c in methods
        ],
    }


def undocumented(parts: Sections) -> list[str]:
    """Keys of :func:`sections`' result whose docstring is empty: a class argument without an ``Args:`` entry."""
    return [e.key for classes in parts.values() for _, entries in classes for e in entries if not e.help]


INTRO = """# Config reference

Every key `python train.py` accepts, generated as its parser reads them (the docs build writes this page with
`fl_lightning.tools.config_reference`). A config file nests the keys (`federation: {rounds: 20}`); on the command line
they are dotted (`--federation.rounds=20`). `model` and `data` name a class (`class_path`) and its arguments
(`init_args`; on the command line `--data.alpha=0.1`); `trainer.callbacks` is the list of methods.
`seed_everything` (default 0) seeds everything; the remaining `trainer.*` keys are
[Lightning's Trainer arguments](https://lightning.ai/docs/pytorch/stable/common/trainer.html#trainer-class-api).
`model.init_args.num_classes`, `in_channels` and `image_size` are linked from the data and need not be set.
"""

HEADINGS = {
    "federation": "The rounds: `federation:`",
    "model": "Client modules: `model:`",
    "data": "Datamodules: `data:`",
    "trainer.callbacks": "Methods: `trainer.callbacks`",
}


def reference_markdown(parts: Sections) -> str:
    """The whole reference page as Markdown, from :func:`sections`' result."""
    lines = [INTRO]
    for section, classes in parts.items():
        lines.append(f"## {HEADINGS[section]}\n")
        for name, entries in classes:
            if section != "federation":
                module = {"model": "fl_lightning.clients", "data": "datamodules", "trainer.callbacks": "callbacks"}
                lines.append(f"### {name}\n\n`class_path: {module[section]}.{name}`\n")
            if not entries:
                lines.append("No arguments.\n")
                continue
            lines += [f"- **`{e.key}`** (`{e.type}`, default `{e.default}`): {e.help}" for e in entries]
            lines.append("")
    return "\n".join(lines)
