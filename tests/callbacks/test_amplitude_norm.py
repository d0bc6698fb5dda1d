"""AmplitudeNormalization in a Federation: own running amplitude in round 1, uniform-mean exchange, frozen after."""

import numpy as np
import pytest
import torch

from callbacks import AmplitudeNormalization, FederatedCallback
from fl_lightning.errors import PreconditionError
from fl_lightning.models.amplitude_norm import AmplitudeNorm
from tests.conftest import build_federation, tiny_data

AMP, FROZEN = "input_norm.amplitude", "input_norm.frozen"


class Uploads(FederatedCallback):
    """Records every client's uploaded amplitude and the amplitude it received, per round."""

    def __init__(self):
        super().__init__()
        self.received, self.uploaded, self.round = {}, {}, 0

    def on_round_start(self, federation, round_idx, selected):
        self.round = round_idx

    def on_client_start(self, ctx, module):
        client_id = ctx.client_id
        self.received[(self.round, client_id)] = module.input_norm.amplitude.detach().clone()

    def on_client_end(self, ctx, module, update):
        client_id = ctx.client_id
        self.uploaded[(self.round, client_id)] = (update.state[AMP].clone(), bool(update.state[FROZEN]))


def ema_of_batch_amplitudes(batches, v):
    """Numpy reference: A = mean|FFT| of the first batch, then A = (1 - v) A + v mean|FFT(batch)|."""
    amp = None
    for x, _ in batches:
        mean = np.abs(np.fft.fft2(x.double().numpy())).mean(0)
        amp = mean if amp is None else (1 - v) * amp + v * mean
    return amp


def test_layer_is_installed_as_model_state(tmp_path):
    fed = build_federation(tmp_path, [AmplitudeNormalization(v=0.2, band=0.5)])
    fed.setup()
    layer = fed.module.input_norm
    assert isinstance(layer, AmplitudeNorm) and layer.v == 0.2 and layer.band == 0.5
    assert layer.amplitude.shape == (1, 8, 8)
    assert {AMP, FROZEN, "input_norm.initialized"} <= set(fed.groups[0].state)
    assert "input_norm.mask" not in fed.groups[0].state  # derived, never sent
    assert not fed.transport.runtime.private_keys


def test_own_amplitude_in_round_one_uniform_mean_then_frozen(tmp_path):
    v = 0.3
    # Dirichlet sizes differ between clients, so a uniform mean differs from FedAvg's sample-weighted one.
    data_kwargs = {
        "num_clients": 3,
        "partition": "dirichlet",
        "alpha": 0.5,
        "max_samples_per_client": None,
        "batch_size": 128,
    }
    probe = Uploads()
    fed = build_federation(tmp_path, [AmplitudeNormalization(v=v), probe], data=tiny_data(**data_kwargs), rounds=3)
    fed.run()
    sizes = [fed.data.num_train_samples(c) for c in fed.data.client_ids]
    assert len(set(sizes)) > 1

    # Round 1: each client starts empty and builds its own running amplitude from its own batches.
    ref_data = tiny_data(**data_kwargs)
    for cid in fed.data.client_ids:
        assert probe.received[(0, cid)].abs().sum() == 0
        amp, frozen = probe.uploaded[(0, cid)]
        expected = ema_of_batch_amplitudes(list(ref_data.client_train_loader(cid)), v)
        np.testing.assert_allclose(amp.numpy(), expected, rtol=1e-5, atol=1e-4)
        assert not frozen
    uploads = [probe.uploaded[(0, c)][0] for c in fed.data.client_ids]
    assert not torch.allclose(uploads[0], uploads[1])

    # The exchange: the uniform mean of the uploads, frozen, in the global model after every round.
    shared = torch.stack(uploads).mean(0)
    final = fed.groups[0].state
    torch.testing.assert_close(final[AMP], shared)
    assert bool(final[FROZEN]) and bool(final["input_norm.initialized"])

    # Rounds 2 and 3: every client receives and uploads exactly the shared amplitude (training left it alone).
    for r in (1, 2):
        for cid in fed.data.client_ids:
            assert torch.equal(probe.received[(r, cid)], final[AMP])
            amp, frozen = probe.uploaded[(r, cid)]
            assert torch.equal(amp, final[AMP]) and frozen


def test_three_channel_images(tmp_path):
    fed = build_federation(tmp_path, [AmplitudeNormalization()], data=tiny_data(channels=3), rounds=2)
    summary = fed.run()
    assert fed.groups[0].state[AMP].shape == (3, 8, 8)
    assert 0.0 <= summary["summary"]["global"]["acc"]["mean"] <= 1.0


def test_needs_a_server_and_an_identity_input_norm(tmp_path):
    fed = build_federation(tmp_path, [AmplitudeNormalization()], topology="peer_to_peer")
    with pytest.raises(PreconditionError, match="topology"):
        fed.run()
    with pytest.raises(ValueError, match="more than once"):
        build_federation(tmp_path, [AmplitudeNormalization(), AmplitudeNormalization()])
    fed = build_federation(tmp_path, [AmplitudeNormalization()])
    fed.setup()  # the layer is installed: a second installation finds no identity to replace
    with pytest.raises(PreconditionError, match="input_norm"):
        AmplitudeNormalization().prepare_module(fed.module, fed.data)


@pytest.mark.parametrize(("kwargs", "match"), [({"v": 0.0}, "v must"), ({"band": -0.1}, "band must")])
def test_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AmplitudeNormalization(**kwargs)


def test_the_default_band_is_the_papers_full_spectrum():
    # The audit's chest X-ray task collapsed on both seeds with the former default 0.25 (docs: "The amplitude band").
    assert AmplitudeNormalization().band == 1.0
