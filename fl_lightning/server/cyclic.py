"""Cyclic weight transfer (Chang et al. 2018): one model visits the round's clients one after another.

No averaging: each client trains the model it receives for its local budget and passes it on; the round's model is
the last client's. The order is a fresh seeded permutation of the round's clients, or their order in the data
(``federation.cycle_order: fixed``, FLamby's ``deterministic_cycle``). It depends only on (seed, round), so a
resumed run visits the clients in the same order.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from fl_lightning.server.reply_check import checked_reply, require_min_clients

if TYPE_CHECKING:
    from collections.abc import Callable

    from fl_lightning.callback import ModelGroup
    from fl_lightning.outputs.round_record import RoundRecord
    from fl_lightning.server.core import Server


def cycle_order(client_ids: list[str], round_idx: int, seed: int, order: str) -> list[str]:
    """The round's visiting order: ``fixed`` keeps ``client_ids``' order, ``random`` draws a seeded permutation."""
    if order == "fixed":
        return list(client_ids)
    perm = np.random.default_rng([seed, round_idx, 3]).permutation(len(client_ids))
    return [client_ids[i] for i in perm.tolist()]


def train_cycle(
    server: Server, r: int, group: ModelGroup, members: list[str], record: RoundRecord, done: Callable[[], None]
) -> None:
    """Round ``r`` of cyclic weight transfer over ``members``: each trains the previous one's model.

    ``done`` is called after each client's reply (the progress bar's step).

    A client whose fit fails is skipped (warned and recorded): the next one receives the model it would have
    received.

    Raises:
        RuntimeError: If every member failed, or fewer than ``federation.min_clients`` replied.
    """
    state, expected = group.state, server.uploaded_keys(group)
    trained = 0  # clients whose model went on
    for cid in cycle_order(members, r, server.seed, server.config.cycle_order):
        group.state = state  # the task carries the model as it is now, not as the round began
        task = server.fit_task(r, group, cid)
        (reply,) = list(record.timed_each("train", server.transport.stream([task])))
        done()
        error = reply.error if reply.error is not None else checked_reply(reply, state, expected)
        if error is not None:
            warnings.warn(f"client {cid!r} failed and is skipped in this cycle: {error}", stacklevel=3)
            record.failed.append(cid)
            continue
        record.add_reply(cid, reply, server.data.batch_size, server.config.local_steps is not None)
        state = {**state, **reply.state}
        trained += 1
    group.state = state
    if not trained:
        raise RuntimeError(f"round {r + 1}: every client of the cycle failed: {members}")
    require_min_clients(server.config.min_clients, r, group.name, members, trained, record.failed)
