"""HarmoFL's amplitude-normalisation layer: the first layer of the client network, its statistics in the model state."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fl_lightning.ops.amplitude import amplitude_phase, band_mask, recompose, replace_amplitude, running_amplitude


class AmplitudeNorm(nn.Module):
    """Replaces each image's Fourier amplitude (inside a centred band) by a running/shared amplitude, keeping its phase.

    Buffers (all in the state dict, so they are aggregated, checkpointed and moved with the model):
    ``amplitude`` (C, H, W), the running or shared amplitude; ``initialized``, whether it holds statistics
    yet; ``frozen``, whether it stays fixed (after HarmoFL's exchange). In training mode and not frozen,
    every batch updates A ← (1 − v)·A + v·mean over the batch of |FFT2(x)| (the first batch sets A).
    Until the first update the layer passes images through unchanged. No gradient reaches the buffer.
    Everything stays on the images' device; the update needs no host synchronisation.

    Args:
        channels: Image channels C.
        image_size: Image (height, width).
        v: Update rate of the running amplitude, in (0, 1].
        band: Fraction of each half-axis of the centred spectrum whose amplitude is replaced (1: all of it;
            0: the zero-frequency term only, a per-channel mean-intensity shift).

    Raises:
        ValueError: On a non-positive size or channel count, ``v`` outside (0, 1] or ``band`` outside [0, 1].

    """

    def __init__(self, channels: int, image_size: tuple[int, int], v: float = 0.1, band: float = 1.0) -> None:
        super().__init__()
        height, width = (int(s) for s in image_size)
        if channels < 1 or height < 1 or width < 1:
            raise ValueError(f"AmplitudeNorm needs positive channels and size, got {channels} x {image_size}")
        if not 0.0 < v <= 1.0:
            raise ValueError(f"AmplitudeNorm v must be in (0, 1], got {v}")
        self.v, self.band = float(v), float(band)
        self.shape = (channels, height, width)
        self.register_buffer("amplitude", torch.zeros(self.shape))
        self.register_buffer("initialized", torch.tensor(False))
        self.register_buffer("frozen", torch.tensor(False))
        # Derived from (size, band), not state: recomputed, never sent.
        self.register_buffer("mask", band_mask(height, width, band), persistent=False)

    def extra_repr(self) -> str:
        """Shape and settings, shown when the model is printed."""
        return f"shape={self.shape}, v={self.v}, band={self.band}"

    def forward(self, x: Tensor) -> Tensor:
        """Images (N, C, H, W) with the amplitude replaced inside the band; same shape and dtype."""
        if x.ndim != 4 or tuple(x.shape[1:]) != self.shape:
            raise ValueError(
                f"AmplitudeNorm expects images (N, {', '.join(map(str, self.shape))}), got {tuple(x.shape)}"
            )
        amplitude, phase = amplitude_phase(x)
        if self.training:
            with torch.no_grad():
                new = running_amplitude(self.amplitude, amplitude.mean(0), self.v, self.initialized)
                # Frozen: keep the shared amplitude. torch.where instead of `if self.frozen` avoids a device sync.
                self.amplitude.copy_(torch.where(self.frozen, self.amplitude, new))
                self.initialized.copy_(self.initialized | ~self.frozen)
        out = recompose(replace_amplitude(amplitude, self.amplitude, self.mask), phase).to(x.dtype)
        return torch.where(self.initialized, out, x)
