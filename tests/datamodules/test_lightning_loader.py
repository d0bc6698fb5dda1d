"""Client loaders under a shared Lightning Trainer: Lightning must not reseed or replace the client samplers."""

from __future__ import annotations

import lightning as L
import torch

from datamodules import DigitsFederated


class _Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 10)
        self.batches: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.batches.append(x.clone())
        return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_shared_trainer_sees_the_clients_own_pass_sequence() -> None:
    dm = DigitsFederated(num_clients=2, image_size=8, batch_size=8, site_styles=False)
    model = _Recorder()
    trainer = L.Trainer(
        max_epochs=0,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    # Rounds interleave the clients, so the Trainer's epoch counter runs ahead of each client's pass counter.
    for _ in range(2):
        for cid in dm.client_ids:
            trainer.fit_loop.max_epochs = trainer.current_epoch + 1
            trainer.fit(model, train_dataloaders=dm.client_train_loader(cid, steps=3))
    assert len(model.batches) == 12
    assert dm.sampler_state() == {"site0": 2, "site1": 2, "__pooled__": 0}

    reference = DigitsFederated(num_clients=2, image_size=8, batch_size=8, site_styles=False)
    expected = {cid: [] for cid in reference.client_ids}
    for _ in range(2):
        for cid in reference.client_ids:
            expected[cid] += [x for x, _ in reference.client_train_loader(cid, steps=3)]
    order = [expected["site0"][0:3], expected["site1"][0:3], expected["site0"][3:6], expected["site1"][3:6]]
    for got, want in zip(model.batches, [b for chunk in order for b in chunk], strict=True):
        assert torch.equal(got, want)
