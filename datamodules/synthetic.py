"""Another federated datamodule's clients, training on the synthetic buffers a FedER run saved (FedER's baselines)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from datamodules.base import ClientSplit, FederatedDataModule
from datamodules.generated import GENERATORS_DIR, data_digest, generator_path, load_node_gan


class SyntheticFederated(FederatedDataModule):
    """The clients of ``base`` with their training sets replaced by (or joined with) their FedER buffers.

    Test sets, batch sizes and seeds are the base's, so evaluation is identical. With
    ``federation.mode: centralized`` this gives FedER's "centralised on synthetic data" and "centralised on
    real + synthetic data" references; with the other modes, any method trained on synthetic data.

    Args:
        base: The datamodule the buffers were generated from (same data and seed as the FedER run).
        generators: A FedER run directory, or its ``generators`` directory (``<node>.pt`` per client).
        train_on: ``synthetic`` (each client trains on its buffer's images and labels only) or
            ``real_and_synthetic`` (its real training set followed by its buffer).

    Raises:
        FileNotFoundError: If a client's generator file is missing, naming it.
        ValueError: If a file was generated from other data than the client's, naming client and file.

    """

    def __init__(
        self,
        base: FederatedDataModule,
        generators: str,
        train_on: Literal["synthetic", "real_and_synthetic"] = "synthetic",
    ) -> None:
        super().__init__(
            batch_size=base.batch_size, eval_batch_size=base.eval_batch_size, test_fraction=base.test_fraction,
            seed=base.seed,
        )  # fmt: skip
        if train_on not in ("synthetic", "real_and_synthetic"):
            raise ValueError(f"train_on must be 'synthetic' or 'real_and_synthetic', got {train_on!r}")
        path = Path(generators)
        self.base, self.train_on = base, train_on
        self.generators = path / GENERATORS_DIR if (path / GENERATORS_DIR).is_dir() else path
        self._source = str(self.generators)

    def _load(self) -> list[ClientSplit]:
        splits = []
        for cid in self.base.client_ids:
            real = self.base.client_data(cid)
            file = generator_path(self.generators, cid)
            stored = load_node_gan(file)
            if stored["fingerprint"].get("data") != data_digest(real.train_x, real.train_y):
                raise ValueError(f"client {cid!r}: {file} was generated from other training data than this client's")
            x, y = stored["images"], stored["labels"]
            if self.train_on == "real_and_synthetic":
                x, y = torch.cat([real.train_x, x]), torch.cat([real.train_y, y])
            # the real data's validation split stays the validation split (the model is chosen on real images)
            splits.append(ClientSplit(cid, x.float(), y.long(), real.test_x, real.test_y, None, real.test_domain,
                                      real.val_x, real.val_y, real.val_domain))  # fmt: skip
        return splits
