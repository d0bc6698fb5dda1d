"""What the server checks of a fit reply before it lets it near the model: a site is not trusted to be well.

A remote site's reply has passed the wire format's checks (:mod:`fl_lightning.wire.protocol`: tensors of known
dtypes and sane sizes), but a site with a bug, a corrupt disk or a broken GPU can still send a well-formed reply
that would poison the aggregate or end the run: an entry the model lacks, a tensor of another shape or dtype,
NaN weights, a negative step count. Such a reply counts as a failed client for that round, as a client whose fit
raised does.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import torch


def fit_reply_problem(
    state: Any,
    num_samples: Any,
    num_steps: Any,
    metrics: Any,
    reference: Mapping[str, torch.Tensor],
    expected: Collection[str],
) -> str | None:
    """Why a fit reply cannot enter the round, or ``None`` if it can.

    Args:
        state: The reply's state (a client may send a part of the model: FedPer withholds its head, secure
            aggregation sends none of it in the clear).
        num_samples: The reply's sample count.
        num_steps: The reply's optimiser step count.
        metrics: The reply's training metrics.
        reference: The group's model: an entry of the reply has its entry's shape and dtype.
        expected: The entries an honest client's reply carries (all of the model's unless a method takes some
            out: :meth:`~fl_lightning.callback.FederatedCallback.uploaded_keys`).

    """
    if not isinstance(state, Mapping):
        return f"its state is a {type(state).__name__}, not a mapping of tensors"
    extra, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
    if extra:
        return f"its state has entries the method does not upload: {extra[:5]}"
    if missing:
        return f"its state lacks entries the method uploads: {missing[:5]}"
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            return f"its entry {key!r} is a {type(value).__name__}, not a tensor"
        ref = reference.get(key)
        if ref is not None and (value.shape != ref.shape or value.dtype != ref.dtype):
            got, want = f"{value.dtype} {tuple(value.shape)}", f"{ref.dtype} {tuple(ref.shape)}"
            return f"its entry {key!r} is {got}, the model's is {want}"
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return f"its entry {key!r} holds non-finite values"
    for name, count in (("sample", num_samples), ("step", num_steps)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            return f"its {name} count is {count!r}, not a non-negative integer"
    if not isinstance(metrics, Mapping):
        return f"its metrics are a {type(metrics).__name__}, not a mapping"
    loss = metrics.get("train_loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss)):
        return f"its training loss is {loss!r}, not a finite number"
    return None


def checked_reply(reply: Any, reference: Mapping[str, torch.Tensor], expected: Collection[str]) -> str | None:
    """:func:`fit_reply_problem` of a :class:`~fl_lightning.wire.protocol.Reply`, worded for the round's warning."""
    state = {} if reply.state is None else reply.state
    problem = fit_reply_problem(state, reply.num_samples, reply.num_steps, reply.metrics, reference, expected)
    return None if problem is None else f"its reply failed the server's checks: {problem}"


def require_min_clients(
    min_clients: int, r: int, group: str, members: list[str], replied: int, failed: list[str]
) -> None:
    """Stop the run when fewer than ``min(min_clients, len(members))`` of a round's selected clients replied.

    Raises:
        RuntimeError: Naming the round (1-based), the group, the counts and the failed clients.
    """
    needed = min(min_clients, len(members))
    if replied < needed:
        raise RuntimeError(
            f"round {r + 1}: only {replied} of the {len(members)} selected clients of group {group!r} replied, "
            f"federation.min_clients asks for {needed}; failed: {failed}. The log and rounds.csv say why each failed; "
            "fix those sites (or lower federation.min_clients) and resume from the last checkpoint"
        )
