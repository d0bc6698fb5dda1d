"""HarmoFL's amplitude normalisation: a running amplitude per client in round 1, then one shared, frozen amplitude."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import refuse_tables
from fl_lightning.errors import PreconditionError
from fl_lightning.models.amplitude_norm import AmplitudeNorm

if TYPE_CHECKING:
    from fl_lightning.callback import ModelGroup, ServerView
    from fl_lightning.ops.state import StateDict
    from fl_lightning.wire.protocol import Reply, Task

LAYER = "input_norm"  # the ClientModule attribute every task passes its inputs through first


class AmplitudeNormalization(FederatedCallback):
    """Harmonises the clients' low-level image statistics in the Fourier domain (HarmoFL, part 1).

    ``prepare_module`` installs an :class:`~fl_lightning.models.amplitude_norm.AmplitudeNorm` layer as
    the client module's ``input_norm`` (so its ``amplitude`` buffer and ``frozen`` flag are model state).
    In the first round the buffer starts empty on every client and each client's local fit builds its
    own running amplitude from its own batches. Each uploaded amplitude then goes into a **uniform**
    mean over the clients that trained (the server never sees a phase); the global model receives that
    mean with ``frozen`` set, so from then on every client and the global model use it unchanged, in
    training and at test time. A client that did not train in round 1 never contributes; it receives
    the shared amplitude like the others. Messages: the amplitude is a buffer of the model, so it travels in
    the reply's state (the client's round-1 amplitude, averaged over its own images: no phase, no image) and
    the shared one in the tasks' state; nothing else is added.

    Preconditions: image data (a table's rows have no spectrum: refused), a client module with an ``input_norm``
    identity to replace, and a server (``federation.topology=star``) to do the exchange.

    Args:
        v: Update rate of the running amplitude, A ← (1 − v)·A + v·Ā_batch, in (0, 1].
        band: Fraction of each half-axis of the centred spectrum whose amplitude is replaced: 1.0 the
            whole spectrum (the paper, the default), 0.0 the zero-frequency term only (the released code), in
            between the low frequencies. A per-task choice, to make on validation data: the full spectrum was best
            on a real chest X-ray task and on the digits classification, 0.25 on the digit segmentation and on
            real retinal vessels (docs: HarmoFL's page, "The amplitude band").

    """

    def __init__(self, v: float = 0.1, band: float = 1.0) -> None:
        super().__init__()
        if not 0.0 < v <= 1.0:
            raise ValueError(f"AmplitudeNormalization v must be in (0, 1], got {v}")
        if not 0.0 <= band <= 1.0:
            raise ValueError(f"AmplitudeNormalization band must be in [0, 1], got {band}")
        self.v, self.band = v, band
        self._sum: dict[str, torch.Tensor] = {}  # group -> Σ of round-1 client amplitudes (server side)
        self._count: dict[str, int] = {}

    @staticmethod
    def key(name: str) -> str:
        """State-dict key of one of the layer's buffers (``amplitude``, ``initialized``, ``frozen``)."""
        return f"{LAYER}.{name}"

    @override
    def prepare_module(self, module: L.LightningModule, data: Any) -> None:
        refuse_tables(data, "callbacks.AmplitudeNormalization")  # an image's Fourier amplitude; a row has none
        current = getattr(module, LAYER, None)
        if not isinstance(current, nn.Identity):
            raise PreconditionError(
                f"AmplitudeNormalization needs a client module whose `{LAYER}` is an identity to replace "
                f"(a ClientModule); {type(module).__name__}.{LAYER} is {type(current).__name__}"
            )
        setattr(module, LAYER, AmplitudeNorm(data.in_channels, data.image_size, v=self.v, band=self.band))

    @override
    def on_federation_start(self, server: ServerView) -> None:
        if not server.has_global_model:
            raise PreconditionError(
                "AmplitudeNormalization exchanges amplitudes through a server; it needs federation.mode=federated "
                f"and federation.topology=star, got topology={server.config.topology!r}"
            )

    @override
    def on_reply(self, server: ServerView, task: Task, reply: Reply, weight: float) -> None:
        if bool(reply.state[self.key("frozen")]):
            return  # after the exchange there is nothing to collect
        amplitude = reply.state[self.key("amplitude")].to(torch.float64)
        group = reply.group
        self._sum[group] = self._sum[group] + amplitude if group in self._sum else amplitude
        self._count[group] = self._count.get(group, 0) + 1

    @override
    def on_aggregate(
        self, server: ServerView, group: ModelGroup, previous: StateDict, averaged: StateDict
    ) -> StateDict:
        amp, frozen, init = self.key("amplitude"), self.key("frozen"), self.key("initialized")
        if bool(previous[frozen]):
            # Exactly the shared amplitude: a weighted mean of identical copies could move its last bits.
            shared = previous[amp]
        elif group.name in self._sum:
            shared = (self._sum.pop(group.name) / self._count.pop(group.name)).to(previous[amp].dtype)
        else:
            return averaged
        return {**averaged, amp: shared.clone(), frozen: torch.tensor(True), init: torch.tensor(True)}
