"""Flower's SecAgg+ mod against our server-side stages (flower_secagg.secure_fit), in one process: sums, dropouts."""

from __future__ import annotations

import time
from itertools import count

import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")

import numpy as np  # noqa: E402
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402

from fl_lightning.engines.flower_secagg import (  # noqa: E402
    REPLY_RECORD,
    Settings,
    client_mod,
    fitres_records,
    secure_fit,
)

SETTINGS = Settings(clipping_range=1.0, quantization_range=2**30, modulus_range=2**40, threshold=0.5, size=50)
_ids = count()


def nodes_running_the_mod(updates: dict[int, np.ndarray], drop: set[int], seen: list[Message]):
    """A ``send`` for secure_fit: each node runs Flower's mod on a context of its own; ``drop`` vanish after sharing
    their keys (no reply to the masking stage or later); ``seen`` collects every reply the server gets."""
    contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={}) for n in updates}

    def fit(_msg: Message, _ctx: Context, nid: int) -> Message:
        content = fitres_records(updates[nid], SETTINGS)
        content.config_records[REPLY_RECORD] = ConfigRecord({"message": b"encoded reply"})
        return Message(content, reply_to=_msg)

    def send(items: list[tuple[int, RecordDict]]) -> list[Message | str]:
        out: list[Message | str] = []
        for nid, content in items:
            stage = content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
            if nid in drop and stage in (Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK):
                out.append("no reply within 60 s")
                continue
            meta = Metadata(1, f"m{next(_ids)}", 0, nid, "", "", time.time(), 60.0, "train")
            reply = client_mod(Message(content, metadata=meta), contexts[nid], lambda m, c, n=nid: fit(m, c, n))
            seen.append(reply)
            out.append(reply)
        return out

    return send


def task_contents(nodes: list[int]) -> dict[int, RecordDict]:
    return {n: RecordDict({"fl.meta": ConfigRecord({"op": "task"})}) for n in nodes}


@pytest.mark.parametrize("drop", [set(), {12}])
def test_secaggplus_sums_the_survivors_updates_and_no_reply_holds_one(drop: set[int]):
    rng = np.random.default_rng(0)
    updates = {n: rng.uniform(-0.5, 0.5, SETTINGS.size) for n in (11, 12, 13)}
    seen: list[Message] = []
    replies, total = secure_fit(nodes_running_the_mod(updates, drop, seen), task_contents(list(updates)), SETTINGS)
    survivors = [n for n in updates if n not in drop]
    assert total is not None and set(replies) == set(updates)
    assert all(isinstance(replies[n], str) for n in drop)
    assert all(replies[n].content.config_records[REPLY_RECORD]["message"] == b"encoded reply" for n in survivors)
    expected = sum(updates[n] for n in survivors)
    assert np.abs(total - expected).max() <= len(survivors) * SETTINGS.quantum()  # stochastic rounding: < 1 step
    # what reached the server: no ArrayRecord with data, and no reply within 10 quanta of one client's update
    for reply in seen:
        assert all(len(rec) == 0 for rec in reply.content.array_records.values())
        masked = reply.content.config_records[RECORD_KEY_CONFIGS].get(Key.MASKED_PARAMETERS)
        if masked is not None:
            from flwr.common import bytes_to_ndarray

            vec = bytes_to_ndarray(masked[1]).astype(np.float64) * SETTINGS.quantum() - SETTINGS.clipping_range
            assert all(np.abs(vec - u).max() > 10 * SETTINGS.quantum() for u in updates.values())


def test_secaggplus_below_its_threshold_fails_every_client_instead_of_a_wrong_sum():
    updates = {n: np.zeros(SETTINGS.size) for n in (11, 12, 13)}
    replies, total = secure_fit(nodes_running_the_mod(updates, {12, 13}, []), task_contents(list(updates)), SETTINGS)
    assert total is None and all(isinstance(r, str) and "threshold" in r for r in replies.values())


def test_a_site_refuses_an_update_outside_the_clipping_range():
    with pytest.raises(OverflowError, match="clipping_range"):
        fitres_records(np.array([0.5, -1.5]), SETTINGS)
