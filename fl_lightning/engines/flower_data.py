"""The server's view of the clients in a Flower deployment: what the sites described, never their data."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from datamodules.base import ClientSplit, FederatedDataModule


class DescribedClients(FederatedDataModule):
    """A datamodule made only of the sites' descriptions: client ids, sample counts and the images' shape.

    The ServerApp instantiates it in place of the run's ``data:`` section, so the model gets its shape
    (``num_classes``, ``in_channels``, ``image_size``, ``num_features`` are linked into it) and the Federation its
    client ids and aggregation weights without the server ever opening a site's data. Anything that needs samples (the
    partition plot, a pooled loader) raises.

    Args:
        description: ``{"clients": {id: [train, test, val]}, "num_classes", "in_channels", "image_size"}``, merged
            from every site's answer (see :meth:`fl_lightning.engines.flower_site.Site.describe`).
        batch_size: The sites' training batch size.
        seed: The data seed.

    """

    def __init__(self, description: dict[str, Any] | None = None, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__(batch_size=batch_size, seed=seed)
        if not description or not description.get("clients"):
            raise ValueError("DescribedClients needs the sites' description (no site described any client)")
        self.description = description
        # [train, test] or [train, test, val]: a site whose data have a validation split counts it too
        self._sizes = {str(c): (int(n[0]), int(n[1]), int(n[2]) if len(n) > 2 else 0)
                       for c, n in description["clients"].items()}  # fmt: skip
        self._source = "the sites' descriptions"

    def _load(self) -> list[ClientSplit]:
        raise RuntimeError("the server of a Flower deployment holds no data; only the sites' descriptions")

    @property
    @override
    def client_ids(self) -> list[str]:
        return list(self._sizes)

    @property
    @override
    def num_classes(self) -> int:
        return int(self.description["num_classes"])

    @property
    @override
    def in_channels(self) -> int:
        return int(self.description["in_channels"])

    @property
    @override
    def image_size(self) -> tuple[int, int]:
        h, w = self.description["image_size"]
        return int(h), int(w)

    @property
    @override
    def num_features(self) -> int:
        """Inputs per sample, C·H·W of the described shape (a table is described as 1 × 1 × F)."""
        h, w = self.image_size
        return self.in_channels * h * w

    @override
    def num_train_samples(self, client_id: str) -> int:
        return self._sizes[client_id][0]

    @override
    def num_test_samples(self, client_id: str) -> int:
        return self._sizes[client_id][1]

    @property
    @override
    def has_validation(self) -> bool:
        return any(sizes[2] for sizes in self._sizes.values())

    @override
    def num_val_samples(self, client_id: str) -> int:
        return self._sizes[client_id][2]

    @override
    def client_data(self, client_id: str) -> ClientSplit:
        raise RuntimeError(f"the server holds no data of client {client_id!r} (it lives on its site)")

    @override
    def label_counts(self, client_id: str, split: str = "train") -> Tensor:
        raise RuntimeError(f"the server does not know client {client_id!r}'s labels (they stay on its site)")

    @override
    def sampler_state(self) -> dict[str, int]:
        return {}

    @override
    def load_sampler_state(self, state: dict[str, int]) -> None:
        pass
