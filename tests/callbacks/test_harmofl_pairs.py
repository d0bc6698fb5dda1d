"""HarmoFL's amplitude layer with the methods that run extra forward passes: one Ψ(x) per batch, one update."""

import torch

from callbacks import AmplitudeNormalization, FederatedCallback, Moon, WeightPerturbation
from tests.conftest import build_federation

AMP = "input_norm.amplitude"


class NetInputs(FederatedCallback):
    """Records every input the network sees in training mode, per batch (Lightning's batch index)."""

    def __init__(self):
        self.per_batch, self.batch = [], None

    def on_runtime_start(self, runtime):
        runtime.module.net.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        if module.training and self.batch is not None:
            self.batch.append(args[0].detach().clone())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = []
        self.per_batch.append(self.batch)


def test_the_perturbed_pass_sees_the_same_normalised_input_in_round_one(tmp_path):
    probe = NetInputs()
    fed = build_federation(tmp_path, [AmplitudeNormalization(v=0.5), WeightPerturbation(alpha=0.1), probe], rounds=1)
    fed.run()
    assert probe.per_batch and all(len(seen) == 2 for seen in probe.per_batch)
    for first, perturbed in probe.per_batch:  # Ψ(x) of the base pass and of the pass at w + δ
        assert torch.equal(first, perturbed)


def test_moon_does_not_update_the_amplitude_a_second_time(tmp_path):
    """The round-1 amplitude depends only on the batches: with MOON's extra passes it must be the same."""
    alone = build_federation(tmp_path / "a", [AmplitudeNormalization(v=0.5)], rounds=1)
    alone.run()
    with_moon = build_federation(tmp_path / "m", [AmplitudeNormalization(v=0.5), Moon(mu=1.0)], rounds=2)
    with_moon.run()
    assert torch.equal(alone.groups[0].state[AMP], with_moon.groups[0].state[AMP])
