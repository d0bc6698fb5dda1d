"""Which layers of a network are its head (the output layer), for methods that share only part of a model.

A head is given by module names (``head: [net.classifier]``) or found: the last ``nn.Linear`` or convolution in
registration order. The rule is refused, with the candidates named, when it would be a guess: no such layer, or a
layer with weights registered after it (a norm or an embedding behind the output layer means the registration
order does not follow the forward pass).
"""

from __future__ import annotations

from torch import nn

from fl_lightning.models.layer_kinds import CONVS

HEAD_KEY = "head"  # the methods' argument naming the head's modules


def _owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def head_modules(model: nn.Module, names: list[str] | None = None, method: str = "the method") -> list[str]:
    """The names of the head's modules in ``model`` (those given, checked, or the one found).

    Raises:
        ValueError: If a given name is no module of ``model`` (listing the candidates), or no head can be found
            without guessing (saying to name it with ``head``).
    """
    modules = dict(model.named_modules())
    linear_like = [n for n, m in modules.items() if isinstance(m, (nn.Linear, *CONVS))]
    if names is not None:
        unknown = [n for n in names if n not in modules or not n]
        if unknown:
            raise ValueError(
                f"{method}: {HEAD_KEY}={names} names no module of the model: {unknown}; its linear and convolution "
                f"layers are {linear_like[-8:]}"
            )
        return list(names)
    if not linear_like:
        raise ValueError(f"{method}: the model has no nn.Linear or convolution to be its head; name it with {HEAD_KEY}")
    last = linear_like[-1]
    order = list(modules)
    after = [n for n in order[order.index(last) + 1 :] if not n.startswith(last + ".") and _owns_state(modules[n])]
    if after:
        raise ValueError(
            f"{method}: the last linear layer {last!r} is followed by layers with weights ({after[:3]}), so which is "
            f"the output layer is ambiguous; name the head's modules with {HEAD_KEY}, e.g. {HEAD_KEY}: [{last}]"
        )
    return [last]


def head_keys(model: nn.Module, names: list[str] | None = None, method: str = "the method") -> set[str]:
    """State-dict keys of the head's modules (their parameters and buffers)."""
    keys: set[str] = set()
    state = model.state_dict()
    for name in head_modules(model, names, method):
        keys.update(k for k in state if k.startswith(name + "."))
    return keys


def split_parameters(model: nn.Module, names: list[str] | None = None, method: str = "the method") -> tuple[list, list]:
    """``(head parameters, body parameters)`` of ``model``, the head as :func:`head_modules` finds or checks it."""
    prefixes = tuple(n + "." for n in head_modules(model, names, method))
    params = list(model.named_parameters())
    return [p for n, p in params if n.startswith(prefixes)], [p for n, p in params if not n.startswith(prefixes)]
