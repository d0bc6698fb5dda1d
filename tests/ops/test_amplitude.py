"""HarmoFL's amplitude normalisation (ops and layer) against numpy FFT references on tiny tensors."""

import numpy as np
import pytest
import torch

from fl_lightning.models.amplitude_norm import AmplitudeNorm
from fl_lightning.ops.amplitude import amplitude_phase, band_mask, recompose, replace_amplitude, running_amplitude


def images(n=4, c=1, h=6, w=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, c, h, w, generator=g, dtype=torch.float64)


def np_reference(x, shared, mask):
    """Numpy: replace |F| by the shared amplitude inside the mask, keep the phase, inverse FFT, real part."""
    f = np.fft.fft2(x.numpy())
    amp = np.where(mask.numpy(), shared.numpy(), np.abs(f))
    return np.real(np.fft.ifft2(amp * np.exp(1j * np.angle(f))))


def np_shifted_window(h, w, band):
    """Independent construction of the band: a centred window on the fftshift-ed grid, shifted back."""
    rh, rw = int(np.floor(band * h / 2)), int(np.floor(band * w / 2))
    shifted = np.zeros((h, w), dtype=bool)
    ch, cw = h // 2, w // 2  # where fftshift puts the zero frequency
    shifted[max(ch - rh, 0) : ch + rh + 1, max(cw - rw, 0) : cw + rw + 1] = True
    return np.fft.ifftshift(shifted)


@pytest.mark.parametrize("c", [1, 3])
def test_decomposition_and_recomposition_match_numpy(c):
    x = images(c=c)
    amp, phase = amplitude_phase(x)
    f = np.fft.fft2(x.numpy())
    np.testing.assert_allclose(amp.numpy(), np.abs(f), rtol=1e-12, atol=1e-12)
    # Phases as unit phasors: a real negative coefficient is +π in one library and −π in the other.
    np.testing.assert_allclose(np.exp(1j * phase.numpy()), np.exp(1j * np.angle(f)), atol=1e-12)
    np.testing.assert_allclose(recompose(amp, phase).numpy(), x.numpy(), atol=1e-12)
    other = amp.flip(0)  # any amplitude: recomposition is real(IFFT(A e^{jP}))
    expected = np.real(np.fft.ifft2(other.numpy() * np.exp(1j * phase.numpy())))
    np.testing.assert_allclose(recompose(other, phase).numpy(), expected, atol=1e-12)


@pytest.mark.parametrize(("h", "w"), [(6, 8), (7, 5), (16, 16)])
@pytest.mark.parametrize("band", [0.0, 0.25, 0.5, 0.8, 1.0])
def test_band_mask_is_the_centred_window(h, w, band):
    mask = band_mask(h, w, band)
    np.testing.assert_array_equal(mask.numpy(), np_shifted_window(h, w, band))
    # Symmetric under k -> -k (mod n): the recomposed image stays real.
    flipped = np.roll(np.flip(mask.numpy(), (0, 1)), (1, 1), (0, 1))
    np.testing.assert_array_equal(mask.numpy(), flipped)
    assert mask[0, 0] and bool(mask.all()) == (band == 1.0)
    if band == 0.0:
        assert int(mask.sum()) == 1


def test_band_mask_rejects_out_of_range():
    with pytest.raises(ValueError, match="band"):
        band_mask(4, 4, 1.5)


@pytest.mark.parametrize("c", [1, 3])
def test_band_one_gives_every_image_the_shared_amplitude_and_its_own_phase(c):
    x = images(c=c)
    shared = amplitude_phase(images(n=6, c=c, seed=1))[0].mean(0)
    amp, phase = amplitude_phase(x)
    out = recompose(replace_amplitude(amp, shared, band_mask(6, 8, 1.0)), phase)
    f_out = np.fft.fft2(out.numpy())
    np.testing.assert_allclose(np.abs(f_out), np.broadcast_to(shared.numpy(), f_out.shape), atol=1e-10)
    # Phase compared as unit phasors (angle wraps at ±π).
    np.testing.assert_allclose(np.exp(1j * np.angle(f_out)), np.exp(1j * phase.numpy()), atol=1e-8)
    np.testing.assert_allclose(out.numpy(), np_reference(x, shared, band_mask(6, 8, 1.0)), atol=1e-12)


@pytest.mark.parametrize("band", [0.0, 0.5])
def test_partial_band_matches_numpy(band):
    x = images(c=3, h=8, w=8)
    shared = amplitude_phase(images(n=5, c=3, h=8, w=8, seed=2))[0].mean(0)
    mask = band_mask(8, 8, band)
    amp, phase = amplitude_phase(x)
    out = recompose(replace_amplitude(amp, shared, mask), phase)
    np.testing.assert_allclose(out.numpy(), np_reference(x, shared, mask), atol=1e-12)


def test_band_zero_is_a_per_channel_mean_shift():
    x = images(c=3)
    shared = amplitude_phase(images(n=5, c=3, seed=3))[0].mean(0)
    amp, phase = amplitude_phase(x)
    out = recompose(replace_amplitude(amp, shared, band_mask(6, 8, 0.0)), phase)
    # |F(0)| / (H W) is the mean intensity (positive images), so only each channel's mean moves.
    target_mean = shared[:, 0, 0] / (6 * 8)
    expected = x - x.mean((-2, -1), keepdim=True) + target_mean.view(1, 3, 1, 1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_running_update_uses_v_and_starts_from_the_first_batch():
    a, b = torch.rand(2, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(running_amplitude(torch.zeros(2, 3, 3, dtype=torch.float64), a, 0.1, False), a)
    torch.testing.assert_close(running_amplitude(a, b, 0.1, True), 0.9 * a + 0.1 * b)
    torch.testing.assert_close(running_amplitude(a, b, 0.3, torch.tensor(True)), 0.7 * a + 0.3 * b)
    torch.testing.assert_close(running_amplitude(a, b, 0.3, torch.tensor(False)), b)


@pytest.mark.parametrize("c", [1, 3])
def test_layer_keeps_a_running_amplitude_then_normalises(c):
    v = 0.2
    layer = AmplitudeNorm(c, (6, 8), v=v).double().train()
    assert set(layer.state_dict()) == {"amplitude", "initialized", "frozen"}
    x0 = images(c=c)
    torch.testing.assert_close(layer.eval()(x0), x0)  # nothing learnt yet: identity
    assert not layer.initialized and layer.amplitude.abs().sum() == 0  # eval did not update
    layer.train()
    expected = None
    for seed in range(4):
        x = images(c=c, seed=seed)
        batch_mean = np.abs(np.fft.fft2(x.numpy())).mean(0)
        expected = batch_mean if expected is None else (1 - v) * expected + v * batch_mean
        out = layer(x)
        np.testing.assert_allclose(layer.amplitude.numpy(), expected, atol=1e-12)
        np.testing.assert_allclose(out.numpy(), np_reference(x, layer.amplitude, layer.mask), atol=1e-12)
    layer.eval()
    before = layer.amplitude.clone()
    x = images(c=c, seed=9)
    np.testing.assert_allclose(layer(x).numpy(), np_reference(x, before, layer.mask), atol=1e-12)
    torch.testing.assert_close(layer.amplitude, before)


def test_frozen_layer_never_updates_in_training():
    layer = AmplitudeNorm(1, (6, 8)).double().train()
    layer(images())
    layer.frozen.fill_(True)
    shared = layer.amplitude.clone()
    for seed in range(3):
        layer(images(seed=seed + 5))
    assert torch.equal(layer.amplitude, shared)


def test_layer_keeps_dtype_and_no_gradient_reaches_the_buffer():
    layer = AmplitudeNorm(3, (8, 8)).train()
    x = torch.rand(2, 3, 8, 8, requires_grad=True)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    out.sum().backward()
    assert not layer.amplitude.requires_grad and x.grad is not None


def test_layer_names_the_expected_shape():
    with pytest.raises(ValueError, match=r"\(N, 1, 6, 8\)"):
        AmplitudeNorm(1, (6, 8))(torch.rand(2, 3, 6, 8))
    with pytest.raises(ValueError, match="v must be"):
        AmplitudeNorm(1, (6, 8), v=0.0)
