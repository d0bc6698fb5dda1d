"""A site's half of secure federated statistics: fresh keys, the masked vector, a mask correction.

Three ``stats`` tasks, named by their ``phase`` option (the server's half:
:mod:`fl_lightning.server.secure_statistics`):

1. ``keys``: the site draws a fresh X25519 key pair per client from the operating system's randomness, keeps the
   private key in memory only (never in a checkpoint or on disk) and answers the public key and the vector's layout.
2. ``sum``: given every keyed client's public key, it sends its statistics vector
   (:func:`~fl_lightning.runtime.site_stats.secure_parts`) fixed-point quantised plus its pairwise masks
   (:mod:`fl_lightning.ops.secagg`): alone, the upload is uniformly random. A client answers this once per
   session: a second answer would release its (noised) statistics twice.
3. ``remask``: when clients that were keyed did not send their upload, each that did sends new mask − old mask over
   the survivors (fresh pair keys, nothing of its data), so that the survivors' masks cancel among themselves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fl_lightning.ops import secagg
from fl_lightning.ops.stats_vector import STATS_BITS
from fl_lightning.runtime import site_stats

GROUP = "stats"  # the mask keys' group (a training round's are the model groups)


def _peers(value: Any, client_id: str) -> dict[str, bytes]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"client {client_id!r}: the secure statistics task's peers are not client → public key")
    return {c: bytes.fromhex(k) for c, k in value.items()}


class SecureStatsSite:
    """The ephemeral keys and the one upload per session of every client a runtime hosts."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}  # client → private key of the current session (memory only)
        self._masked: dict[str, tuple[str, list[str], int]] = {}  # client → (session, peers, size) it masked for

    def answer(self, data: Any, client_id: str, options: dict[str, Any], rules: dict[str, Any]) -> dict[str, Any]:
        """The metrics of a reply to one phase of secure statistics (``options["phase"]``).

        Raises:
            ValueError: On a phase out of order or a task that could make the upload readable (named).
        """
        phase = options.get("phase")
        if phase == "keys":
            self._keys[client_id] = secagg.generate_private_key()
            self._masked.pop(client_id, None)
            spec = site_stats.secure_layout(data, client_id, int(rules["bins"]))  # no statistic computed yet
            return {"public_key": secagg.public_key(self._keys[client_id]).hex(), "layout": spec}
        if phase == "sum":
            return self._sum(data, client_id, options, rules)
        if phase == "remask":
            return self._remask(client_id, options)
        raise ValueError(f"client {client_id!r}: unknown secure statistics phase {phase!r}")

    def _private(self, client_id: str) -> bytes:
        private = self._keys.get(client_id)
        if private is None:
            raise ValueError(f"client {client_id!r} holds no statistics key (its site restarted after the keys phase?)")
        return private

    def _sum(self, data: Any, client_id: str, options: dict[str, Any], rules: dict[str, Any]) -> dict[str, Any]:
        private, peers = self._private(client_id), _peers(options.get("peers"), client_id)
        session = str(options.get("session"))
        if client_id not in peers or len(peers) < 2:
            raise ValueError(f"client {client_id!r} masks only among two clients or more, itself one of them")
        if client_id in self._masked:
            raise ValueError(f"client {client_id!r} already sent its statistics of this session: it sends them once")
        spec, vector, flags = site_stats.secure_parts(data, client_id, rules)
        if spec != options.get("layout"):
            raise ValueError(f"client {client_id!r}: its statistics' layout {spec} is not the server's")
        mask = secagg.client_mask(client_id, private, peers, vector.numel(), session, 0, GROUP)
        upload = secagg.masked_upload(vector, mask, STATS_BITS, len(peers))
        self._masked[client_id] = (session, sorted(peers), vector.numel())
        return {"masked": upload, "flags": flags}

    def _remask(self, client_id: str, options: dict[str, Any]) -> dict[str, Any]:
        masked = self._masked.get(client_id)
        before, after = _peers(options.get("before"), client_id), _peers(options.get("after"), client_id)
        checks = {
            "it sent no upload of that session": masked is not None and masked[0] == options.get("session"),
            "the peers it masked with are not those": masked is not None and sorted(before) == masked[1],
            "the new peers are not two or more of the old ones with it": (
                client_id in after and len(after) >= 2 and set(after) < set(before)
            ),
        }
        bad = [why for why, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"client {client_id!r} refuses to re-mask its statistics: {'; '.join(bad)}")
        assert masked is not None
        session, size = masked[0], masked[2]
        retry = secagg.retry_session(session, set(before) - set(after))
        correction = secagg.mask_correction(
            client_id, self._private(client_id), before, after, size, (session, retry), 0, GROUP
        )
        self._masked[client_id] = (retry, sorted(after), size)
        return {"correction": torch.from_numpy(correction.view(np.int64).copy())}
