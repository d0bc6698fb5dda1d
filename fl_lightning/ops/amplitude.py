"""HarmoFL's Fourier amplitude normalisation as pure, batched tensor functions (no numpy, any device)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def amplitude_phase(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-image, per-channel amplitude |F| and phase angle(F) of F = FFT2(x) over the last two dims.

    Args:
        x: Real images (..., H, W); half precision is computed in float32 (cuFFT needs powers of two in half).

    Returns:
        ``(amplitude, phase)``, float tensors of the shape of ``x`` (unshifted spectrum layout).

    """
    spectrum = torch.fft.fft2(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x)
    return spectrum.abs(), spectrum.angle()


def recompose(amplitude: Tensor, phase: Tensor) -> Tensor:
    """real(IFFT2(A · e^{jP})): the image with amplitude ``amplitude`` and phase ``phase``.

    Args:
        amplitude: Amplitude (..., H, W), broadcastable against ``phase``.
        phase: Phase (..., H, W).

    Returns:
        Real images of the broadcast shape.

    """
    return torch.fft.ifft2(torch.polar(amplitude.expand_as(phase).contiguous(), phase)).real


def band_mask(height: int, width: int, band: float, device: torch.device | str | None = None) -> Tensor:
    """Where the amplitude is replaced: the centred low-frequency window covering ``band`` of each half-axis.

    Frequency (k_h, k_w), signed as in ``fftfreq`` (−n/2 … n/2 − 1), is in the window when
    |k_h| ≤ ⌊band·H/2⌋ and |k_w| ≤ ⌊band·W/2⌋. So ``band=1`` is the whole spectrum, ``band=0`` the
    zero-frequency term only (a per-channel mean-intensity shift, what HarmoFL's released code does),
    and the window is symmetric under k → −k, which keeps the recomposed image real.

    Args:
        height: Image height H.
        width: Image width W.
        band: Fraction in [0, 1] of each half-axis that the window covers.
        device: Device of the mask.

    Returns:
        A bool tensor (H, W) in the unshifted spectrum layout (True = replaced).

    Raises:
        ValueError: If ``band`` is outside [0, 1].

    """
    if not 0.0 <= band <= 1.0:
        raise ValueError(f"band must be in [0, 1], got {band}")

    def axis(n: int) -> Tensor:
        # |signed frequency| of each index: Nyquist (n/2, even n) counts as n/2 and is its own conjugate.
        k = torch.arange(n, device=device)
        dist = torch.minimum(k, n - k)
        return dist <= math.floor(band * n / 2)

    return axis(height)[:, None] & axis(width)[None, :]


def replace_amplitude(amplitude: Tensor, shared: Tensor, mask: Tensor) -> Tensor:
    """The images' own amplitude, with the shared amplitude inside the band window.

    Args:
        amplitude: The images' amplitude (N, C, H, W).
        shared: The shared amplitude (C, H, W).
        mask: Band window (H, W) from :func:`band_mask`.

    Returns:
        The amplitude to recompose with, (N, C, H, W).

    """
    return torch.where(mask, shared.to(amplitude.dtype), amplitude)


def running_amplitude(running: Tensor, batch_mean: Tensor, v: float, initialized: Tensor | bool) -> Tensor:
    """One step of A_k = (1 − v)·A_{k−1} + v·Ā_b, starting from A_0 = Ā_b of the first batch.

    Args:
        running: The running amplitude A_{k−1} (C, H, W).
        batch_mean: The batch's mean amplitude Ā_b (C, H, W).
        v: Update rate in (0, 1].
        initialized: Whether ``running`` holds statistics yet (False: return ``batch_mean``); a bool tensor
            keeps the update free of host-device synchronisation.

    Returns:
        The new running amplitude (a new tensor).

    """
    updated = torch.lerp(running, batch_mean.to(running.dtype), v)
    if isinstance(initialized, Tensor):
        return torch.where(initialized, updated, batch_mean.to(running.dtype))
    return updated if initialized else batch_mean.to(running.dtype).clone()
