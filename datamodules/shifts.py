"""Per-site imaging styles: pure, seeded intensity transforms that create feature shift between clients.

Medical sites differ in scanner contrast, gamma, sharpness, noise, polarity and colour; :class:`SiteStyle` captures
those knobs and :func:`apply_style` applies them to a batch once, so a client's data is fixed across rounds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from datamodules.sampler import stable_seed

# The first five sites are fixed so experiments (and the numbers in DESIGN.md) are comparable across seeds:
# clean; gamma + low contrast; inverted; blurred + gain; noisy + low contrast.
_FIXED_STYLES: tuple[dict[str, float | bool], ...] = (
    {},
    {"gamma": 1.8, "contrast": 0.5},
    {"invert": True},
    {"blur_sigma": 1.0, "gain": 1.3},
    {"noise_std": 0.15, "contrast": 0.6},
)

# Distinct tints for the fixed RGB sites; site 0 stays neutral.
_FIXED_TINTS: tuple[tuple[float, float, float], ...] = (
    (1.0, 1.0, 1.0),
    (1.0, 0.75, 0.75),
    (0.75, 1.0, 0.75),
    (0.75, 0.75, 1.0),
    (1.0, 1.0, 0.65),
)


@dataclass(frozen=True)
class SiteStyle:
    """Imaging style of one site, applied in the order contrast, gamma, gain, blur, tint, noise, invert.

    The default instance is the identity.

    Attributes:
        contrast: Scale of intensities around 0.5 (< 1 flattens contrast).
        gamma: Exponent applied to intensities (> 1 darkens mid-tones).
        blur_sigma: Standard deviation in pixels of a Gaussian blur (0 disables it).
        noise_std: Standard deviation of additive Gaussian noise (0 disables it).
        invert: Whether intensities are inverted (``1 - x``).
        gain: Multiplicative intensity gain.
        tint: Per-channel multipliers (R, G, B), used only for 3-channel images.

    """

    contrast: float = 1.0
    gamma: float = 1.0
    blur_sigma: float = 0.0
    noise_std: float = 0.0
    invert: bool = False
    gain: float = 1.0
    tint: tuple[float, float, float] | None = None


def _random_style(rng: np.random.Generator) -> SiteStyle:
    """Draws a style over the same knobs as the fixed sites, within similar ranges."""
    return SiteStyle(
        contrast=float(rng.uniform(0.5, 1.2)),
        gamma=float(rng.uniform(0.6, 1.8)),
        blur_sigma=float(rng.uniform(0.5, 1.2)) if rng.random() < 0.4 else 0.0,
        noise_std=float(rng.uniform(0.03, 0.15)) if rng.random() < 0.4 else 0.0,
        invert=bool(rng.random() < 0.3),
        gain=float(rng.uniform(0.8, 1.3)),
    )


def default_site_styles(num_sites: int, seed: int, channels: int = 1) -> list[SiteStyle]:
    """Returns one style per site: five fixed styles, then seeded random ones.

    Site ``i``'s random style is drawn from its own generator (``stable_seed(seed, "site_style", i)``), so it does
    not change when ``num_sites`` changes.

    Args:
        num_sites: Number of sites (>= 0).
        seed: Seed for the styles beyond the fifth and for their tints.
        channels: Image channels; with 3, every site also gets a distinct colour tint (site 0 neutral).

    Returns:
        A list of ``num_sites`` styles.

    Raises:
        ValueError: If ``num_sites`` is negative or ``channels`` is not 1 or 3.

    """
    if num_sites < 0:
        raise ValueError(f"num_sites must be >= 0, got {num_sites}")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    styles: list[SiteStyle] = []
    for site in range(num_sites):
        rng = np.random.default_rng(stable_seed(seed, "site_style", site))
        style = SiteStyle(**_FIXED_STYLES[site]) if site < len(_FIXED_STYLES) else _random_style(rng)
        if channels == 3:
            if site < len(_FIXED_TINTS):
                tint = _FIXED_TINTS[site]
            else:
                tint = tuple(float(v) for v in rng.uniform(0.6, 1.0, size=3))
            style = dataclasses.replace(style, tint=tint)
        styles.append(style)
    return styles


def _gaussian_kernel(sigma: float, max_radius: int) -> torch.Tensor:
    """Normalised 1-D Gaussian kernel with radius ceil(3 sigma), capped so it fits the image."""
    radius = max(1, min(math.ceil(3.0 * sigma), max_radius))
    x = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (x / sigma) ** 2)
    return kernel / kernel.sum()


def _blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of an (N, C, H, W) batch; replicate padding keeps the mean close to the input's."""
    _, channels, height, width = images.shape
    kernel = _gaussian_kernel(sigma, max_radius=max(1, max(height, width) - 1)).to(images)
    radius = (len(kernel) - 1) // 2
    # Depthwise convolution: one copy of the kernel per channel, applied along W then H.
    kx = kernel.view(1, 1, 1, -1).repeat(channels, 1, 1, 1)
    ky = kernel.view(1, 1, -1, 1).repeat(channels, 1, 1, 1)
    out = F.conv2d(F.pad(images, (radius, radius, 0, 0), mode="replicate"), kx, groups=channels)
    return F.conv2d(F.pad(out, (0, 0, radius, radius), mode="replicate"), ky, groups=channels)


def apply_style(images: torch.Tensor, style: SiteStyle, seed: int) -> torch.Tensor:
    """Applies a site style to a batch of images; pure: the same inputs and seed give the same output.

    Order: contrast around 0.5, gamma, gain, Gaussian blur, tint (3 channels only), additive noise, inversion,
    clamp to [0, 1]. Steps whose parameter is the identity are skipped, so ``SiteStyle()`` returns an exact copy.

    Args:
        images: Float tensor (N, C, H, W) with values in [0, 1]. Not modified.
        style: The style to apply.
        seed: Seed of the private generator used for the noise.

    Returns:
        A new float tensor of the same shape with values in [0, 1].

    Raises:
        ValueError: If ``images`` is not a 4-D floating-point tensor.

    """
    if images.ndim != 4 or not images.is_floating_point():
        raise ValueError(f"apply_style expects a float (N, C, H, W) tensor, got {images.dtype} {tuple(images.shape)}")
    x = images.clone()
    if style.contrast != 1.0:
        x = (x - 0.5) * style.contrast + 0.5
    if style.gamma != 1.0:
        # Clamp first: a fractional power of a negative value (possible after contrast > 1) is NaN.
        x = x.clamp(0.0, 1.0).pow(style.gamma)
    if style.gain != 1.0:
        x = x * style.gain
    if style.blur_sigma > 0.0 and x.numel():
        x = _blur(x, style.blur_sigma)
    if style.tint is not None and x.shape[1] == 3:
        x = x * torch.tensor(style.tint, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    if style.noise_std > 0.0:
        # A private CPU generator: the noise must not depend on (or disturb) the global RNG state or the device.
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        x = x + style.noise_std * noise.to(x.device)
    if style.invert:
        x = 1.0 - x
    return x.clamp(0.0, 1.0)
