"""A trial's values as ``train.py`` arguments: one ``--key=value`` per setting, one list for the callbacks.

A callback's argument is addressed by the callback's class name, as the resume check and the config reference name
it (``trainer.callbacks[FedProx].mu``; the second callback of a class is ``[FedProx#2]``), or by its position in
the list (``trainer.callbacks[0].mu``; ``init_args.`` after the bracket may be written or left out). LightningCLI's
own ``--trainer.callbacks.init_args.mu`` reaches only the last callback, so a trial that changes a callback's
argument passes the whole resolved list again (``--trainer.callbacks=[...]``, JSON) with its values in it: the
other callbacks and their arguments stay as the config resolved them.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

CALLBACKS = "trainer.callbacks"
_CALLBACK_KEY = re.compile(r"^trainer\.callbacks\[([^\]]+)\]\.(?:init_args\.)?(.+)$")


class KeyNotFound(KeyError):
    """A space key that the parsed config does not have; the message names it and the keys near it."""

    def __str__(self) -> str:
        return str(self.args[0])


def is_callback_key(key: str) -> bool:
    """Whether ``key`` addresses a callback's argument (``trainer.callbacks[...]...``)."""
    return key.startswith(CALLBACKS + "[")


def callback_address(key: str) -> tuple[str, list[str]]:
    """``trainer.callbacks[FedProx].mu`` → ``("FedProx", ["mu"])``; nested arguments give longer paths.

    Raises:
        KeyNotFound: If ``key`` is not of that form.
    """
    match = _CALLBACK_KEY.match(key)
    if match is None:
        raise KeyNotFound(
            f"{key}: a callback's argument is written trainer.callbacks[<Class>].<argument> "
            "(trainer.callbacks[FedProx].mu) or trainer.callbacks[<index>].<argument>"
        )
    return match.group(1), match.group(2).split(".")


def as_list(callbacks: Any) -> list[dict[str, Any]]:
    """The resolved ``trainer.callbacks`` as a list of ``{class_path, init_args}`` (None → [], one → [one])."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Mapping):
        return [dict(callbacks)]
    return [dict(c) for c in callbacks]


def callback_index(callbacks: Sequence[Mapping[str, Any]], ref: str, key: str) -> int:
    """The position in ``callbacks`` that ``ref`` (``FedProx``, ``FedProx#2`` or ``0``) names.

    Raises:
        KeyNotFound: Naming ``key`` and listing the config's callbacks.
    """
    names = [str(c.get("class_path", "")).rsplit(".", 1)[-1] for c in callbacks]
    listed = ", ".join(f"[{i}] {n}" for i, n in enumerate(names)) or "none"
    if ref.isdigit():
        if int(ref) < len(callbacks):
            return int(ref)
    else:
        name, _, nth = ref.partition("#")
        hits = [i for i, n in enumerate(names) if n == name]
        k = int(nth) if nth.isdigit() else 1
        if 1 <= k <= len(hits):
            return hits[k - 1]
    raise KeyNotFound(f"{key}: the config has no callback {ref!r}; its callbacks: {listed}")


def lookup(config: Mapping[str, Any], key: str) -> Any:
    """The value ``key`` holds in the resolved config (a callback's argument included).

    Raises:
        KeyNotFound: If the config has no such key, naming the nearest keys it has.
    """
    if is_callback_key(key):
        ref, path = callback_address(key)
        callbacks = as_list(_walk(config, CALLBACKS.split("."), CALLBACKS))
        entry = callbacks[callback_index(callbacks, ref, key)]
        return _walk(entry.get("init_args") or {}, path, key, prefix=f"{CALLBACKS}[{ref}]")
    return _walk(config, key.split("."), key)


def _walk(node: Any, path: list[str], key: str, prefix: str = "") -> Any:
    done: list[str] = []
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            where = ".".join([prefix, *done] if prefix else done) or "the config"
            near = sorted(node) if isinstance(node, Mapping) else []
            hint = f"; {where} has: {', '.join(map(str, near))}" if near else f" ({where} is not a section)"
            raise KeyNotFound(f"{key}: not a key of the parsed config{hint}")
        node = node[part]
        done.append(part)
    return node


def format_value(value: Any) -> str:
    """A value as an override's text that the parser reads back as the same value (``1e-05`` as ``1.0e-05``).

    PyYAML reads ``1e-05`` (no dot) as a string; a float is written so that it reads as a float again.
    """
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        text = repr(value)
        if "e" in text and "." not in text.split("e")[0]:
            mantissa, exponent = text.split("e")
            text = f"{mantissa}.0e{exponent}"
        return text
    return str(value)


def trial_overrides(values: Mapping[str, Any], callbacks: Any) -> list[str]:
    """``train.py`` arguments that set ``values`` (``{key: value}``, searched and fixed keys alike).

    Args:
        values: The trial's settings by space key.
        callbacks: The resolved ``trainer.callbacks`` of the config (and of the extra overrides).

    Returns:
        One ``--key=value`` per plain key, in ``values``' order, then (if any key addresses a callback) one
        ``--trainer.callbacks=<JSON list>`` holding every callback of the config with the trial's values set.
    """
    args = [f"--{k}={format_value(v)}" for k, v in values.items() if not is_callback_key(k)]
    changed = {k: v for k, v in values.items() if is_callback_key(k)}
    if changed:
        listed = copy.deepcopy(as_list(callbacks))
        for key, value in changed.items():
            ref, path = callback_address(key)
            entry = listed[callback_index(listed, ref, key)]
            node = entry.setdefault("init_args", {})
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        args.append(f"--{CALLBACKS}={json.dumps(listed)}")
    return args
