"""LG-FedAvg: the reverse of FedPer — the representation stays on each client, the head is shared."""

from __future__ import annotations

import lightning as L
from typing_extensions import override

from callbacks.head_body.fedper import FedPer
from callbacks.head_body.heads import head_keys


class LGFedAvg(FedPer):
    """LG-FedAvg (Liang et al., 2020): local representations v_i, a global head averaged as in FedAvg.

    Everything but the head (weights and buffers: norm statistics too) stays on the client and never leaves it;
    only the head is uploaded and averaged. The global model's body stays the initial one, so ``personal`` is the
    evaluation that means something. The head is found as :class:`~callbacks.FedPer` finds it.

    Args:
        head: Module names of the head (None: found).
    """

    @override
    def withheld_keys(self, module: L.LightningModule) -> set[str]:
        return set(module.state_dict()) - head_keys(module, self.head, type(self).__name__)
