"""Per-site imaging styles: pure, seeded intensity transforms that create feature shift between clients.

Medical sites differ in scanner contrast, gamma, sharpness, noise, polarity and colour; :class:`SiteStyle` captures
those knobs and :func:`apply_style` applies them to a batch once, so a client's data is fixed across rounds.

Modality-true styles model what real sites' scanners and labs do: an MRI coil's smooth bias field
(``bias_field``), the Rician noise of magnitude images (``rician_noise``), Gibbs ringing from a truncated k-space
(``gibbs``), a k-space spike's herringbone stripes (``kspace_spikes``) and a histology lab's H&E stain variation
(``stain_he``, RGB images only). They follow MONAI's transforms (``RandBiasField``, ``RandRicianNoise``,
``GibbsNoise``, ``KSpaceSpikeNoise``; the tests compare against them) but are written in torch/numpy, so they need
neither the ``medical`` extra nor MONAI's import.

The datamodules' ``site_styles`` argument takes ``true`` (the default sequence: site ``i`` gets fixed style ``i``,
then seeded random ones), ``false`` (none), or a list with one style per site, each given as

* a name from :data:`NAMED_STYLES` (``clean``, ``low_contrast``, ``dark``, ``blurred``, ``noisy``, ``inverted``, …,
  ``bias_field``, ``rician_noise``, ``gibbs``, ``kspace_spikes``, ``stain_he``, or ``random`` for the seeded random
  style of that site);
* parameters, alone or on top of a name, joined by ``+``: ``contrast=0.7+noise_std=0.05``,
  ``low_contrast+blur_sigma=0.8``, ``tint=1/0.8/0.8`` (R/G/B), ``bias_field=0.5+rician_noise=0.1``; later parts
  override earlier ones;
* a mapping of :class:`SiteStyle` fields (``{contrast: 0.7, noise_std: 0.05}``, ``{bias_field: 0.3}`` in YAML) or a
  ``SiteStyle``.

So a shift can fit the modality: an X-ray study may want ``[clean, low_contrast, dark, noisy, blurred]`` and no
``inverted`` site, which models a polarity flip that no X-ray scanner produces. See :func:`resolve_site_styles`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from datamodules.sampler import stable_seed

# Named styles for ``site_styles: [...]`` (parameters as in SiteStyle). The first five are the default sites 0-4.
NAMED_STYLES: dict[str, dict[str, float | bool]] = {
    "clean": {},  # the identity
    "gamma_low_contrast": {"gamma": 1.8, "contrast": 0.5},  # dark mid-tones, half the contrast
    "inverted": {"invert": True},  # polarity flip
    "blurred_gain": {"blur_sigma": 1.0, "gain": 1.3},  # soft focus, over-exposed
    "noisy_low_contrast": {"noise_std": 0.15, "contrast": 0.6},  # heavy noise on flat contrast
    "low_contrast": {"contrast": 0.5},
    "high_contrast": {"contrast": 1.5},
    "dark": {"gamma": 1.8},
    "bright": {"gamma": 0.6},
    "blurred": {"blur_sigma": 1.0},
    "noisy": {"noise_std": 0.1},
    "overexposed": {"gain": 1.3},
    "underexposed": {"gain": 0.7},
    # Modality-true styles: each name sets the parameter of the same name to a typical value.
    "bias_field": {"bias_field": 0.3},  # MRI coil inhomogeneity: smooth multiplicative field
    "rician_noise": {"rician_noise": 0.3},  # MRI magnitude noise, std 0.3 x the image's std
    "gibbs": {"gibbs": 0.7},  # ringing and blur from a k-space cut at 0.3 x the corner radius
    "kspace_spikes": {"kspace_spikes": 0.1},  # one k-space spike: herringbone stripes of amplitude 0.05-0.1
    "stain_he": {"stain_he": 0.2},  # H&E stain variation (RGB only): stains scaled 0.8-1.2, shifted +-0.2 OD
}
# Not a fixed style: the seeded random style of the site (as sites >= 5 get with ``site_styles: true``).
RANDOM_STYLE = "random"

# The first five sites are fixed so experiments (and the numbers in DESIGN.md) are comparable across seeds:
# clean; gamma + low contrast; inverted; blurred + gain; noisy + low contrast.
DEFAULT_SITE_SEQUENCE = ("clean", "gamma_low_contrast", "inverted", "blurred_gain", "noisy_low_contrast")
_FIXED_STYLES: tuple[dict[str, float | bool], ...] = tuple(NAMED_STYLES[name] for name in DEFAULT_SITE_SEQUENCE)

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
    """Imaging style of one site.

    Applied in the order stain_he, bias_field, gibbs, kspace_spikes, rician_noise (the acquisition: what the
    slide, coil and k-space do to the signal), then contrast, gamma, gain, blur, tint, noise, invert. The default
    instance is the identity. Intensities are in [0, 1] and clamped to it at the end. Every random draw comes from
    the seed :func:`apply_style` gets (one per site): a site's field, spike and stain factors are the same for all
    its images and in every run; only the noises (``noise_std``, ``rician_noise``) differ from image to image.

    Attributes:
        contrast: Scale of intensities around 0.5, ``(x - 0.5) * contrast + 0.5``; > 0, < 1 flattens contrast
            (0.5 halves it), > 1 stretches it.
        gamma: Exponent ``x ** gamma``; > 0, > 1 darkens mid-tones (1.8: 0.5 → 0.29), < 1 brightens them.
        blur_sigma: Standard deviation in pixels of a separable Gaussian blur, >= 0 (0 disables it; 1.0 on a
            16-pixel digit softens strokes to about 3 pixels).
        noise_std: Standard deviation of additive Gaussian noise, >= 0 (0 disables it; 0.15 is heavy), seeded
            per client so it is the same in every round.
        invert: Whether intensities are inverted (``1 - x``): a polarity flip (e.g. MR sequences, negatives).
        gain: Multiplicative intensity gain, > 0 (> 1 over-exposes: bright areas saturate at the clamp).
        tint: Per-channel multipliers (R, G, B), each >= 0, used only for 3-channel images.
        bias_field: MRI bias field (coil inhomogeneity), >= 0 (0 disables it): the image is multiplied by
            ``exp(f)``, ``f`` a degree-3 Legendre polynomial on [-1, 1]² as in MONAI's ``RandBiasField``, with
            10 coefficients drawn per site uniformly in ``(-bias_field, bias_field)`` (0.3: gains of about
            0.5-2 across the image).
        rician_noise: Rician noise of MRI magnitude images, >= 0 (0 disables it): ``sqrt((x + n1)² + n2²)`` with
            ``n1``, ``n2`` Gaussian of standard deviation ``rician_noise`` times the image's own intensity
            standard deviation (MONAI's ``RandRicianNoise`` with ``relative=True``); drawn per image from the
            site's generator, like ``noise_std``.
        gibbs: Gibbs ringing, in [0, 1] (0 disables it): k-space is cut to a disc of radius ``(1 - gibbs)``
            times half the image diagonal (MONAI's ``GibbsNoise`` with ``alpha=gibbs``); deterministic.
        kspace_spikes: A k-space spike (herringbone artefact), >= 0 (0 disables it): one k-space point (drawn
            per site, never the centre) gets the magnitude ``a * H * W`` (MONAI's ``KSpaceSpikeNoise`` with
            log-intensity ``log(a H W)``), which adds stripes of amplitude about ``a``; ``a`` is drawn per site
            uniformly in ``[kspace_spikes / 2, kspace_spikes]``.
        stain_he: H&E stain variation of histology RGB images, in [0, 1) (0 disables it): colour deconvolution
            to haematoxylin, eosin and DAB optical densities (Ruifrok & Johnston's stain matrix, as
            scikit-image's ``rgb2hed``), each stain scaled by a factor in ``[1 - stain_he, 1 + stain_he]`` and
            shifted by an amount in ``[-stain_he, stain_he]`` (drawn per site), then back to RGB. Refused for
            images that do not have 3 channels.

    Raises:
        ValueError: If a parameter is outside its range, naming it.

    """

    contrast: float = 1.0
    gamma: float = 1.0
    blur_sigma: float = 0.0
    noise_std: float = 0.0
    invert: bool = False
    gain: float = 1.0
    tint: tuple[float, float, float] | None = None
    bias_field: float = 0.0
    rician_noise: float = 0.0
    gibbs: float = 0.0
    kspace_spikes: float = 0.0
    stain_he: float = 0.0

    def __post_init__(self) -> None:
        bad = {
            "contrast": not self.contrast > 0,
            "gamma": not self.gamma > 0,
            "blur_sigma": not self.blur_sigma >= 0,
            "noise_std": not self.noise_std >= 0,
            "gain": not self.gain > 0,
            "tint": self.tint is not None and (len(self.tint) != 3 or not all(v >= 0 for v in self.tint)),
            "bias_field": not self.bias_field >= 0,
            "rician_noise": not self.rician_noise >= 0,
            "gibbs": not 0 <= self.gibbs <= 1,
            "kspace_spikes": not self.kspace_spikes >= 0,
            "stain_he": not 0 <= self.stain_he < 1,
        }
        wrong = [f"{k}={getattr(self, k)!r}" for k, is_bad in bad.items() if is_bad]
        if wrong:
            raise ValueError(
                f"invalid site style {', '.join(wrong)} (contrast, gamma and gain > 0; blur_sigma, noise_std, "
                f"bias_field, rician_noise and kspace_spikes >= 0; gibbs in [0, 1]; stain_he in [0, 1); tint three "
                f"values >= 0)"
            )


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


StyleSpec = str | SiteStyle | Mapping[str, Any]


def resolve_site_styles(
    site_styles: bool | Sequence[StyleSpec], num_sites: int, seed: int, channels: int = 1
) -> list[SiteStyle] | None:
    """The style of every site for a datamodule's ``site_styles`` argument.

    Args:
        site_styles: ``True`` for :func:`default_site_styles` (unchanged: fixed sites 0-4, then seeded random
            ones; RGB sites tinted), ``False`` for none, or one spec per site (see the module docstring; a list
            gives exactly the styles it names, tints included).
        num_sites: Number of styles needed (sites, or domains where the datamodule styles by domain).
        seed: Seed of the random styles (``random`` and the default sequence beyond site 4).
        channels: Image channels (1 or 3); with ``True`` and 3, every site also gets a distinct tint.

    Returns:
        ``num_sites`` styles, or ``None`` for ``False``.

    Raises:
        ValueError: If the list does not hold one entry per site, or an entry names an unknown style or
            parameter or a value out of range, naming the entry.

    """
    if site_styles is True:
        return default_site_styles(num_sites, seed, channels=channels)
    if site_styles is False or site_styles is None:
        return None
    if isinstance(site_styles, (str, Mapping, SiteStyle)):  # one style is not a list of per-site styles
        raise ValueError(f"site_styles must be true, false or a list with one style per site; got {site_styles!r}")
    specs = list(site_styles)
    if not specs:
        raise ValueError("site_styles is an empty list: give one style per site, or true / false")
    if len(specs) != num_sites:
        raise ValueError(f"site_styles lists {len(specs)} styles for {num_sites} sites; give one per site")
    return [parse_style(spec, seed, site) for site, spec in enumerate(specs)]


def parse_style(spec: StyleSpec, seed: int = 0, site: int = 0) -> SiteStyle:
    """One site's style from a name, ``name+key=value`` parts, a mapping of fields or a :class:`SiteStyle`.

    Args:
        spec: The style (see the module docstring).
        seed: Seed of ``random``.
        site: The site's index (``random`` draws that site's seeded style, independent of the other sites).

    Raises:
        ValueError: On an unknown name or parameter, a malformed value or a value out of range, naming them.

    """
    if isinstance(spec, SiteStyle):
        return spec
    if not isinstance(spec, (str, Mapping)) and hasattr(spec, "as_dict"):  # a jsonargparse Namespace
        spec = spec.as_dict()
    if isinstance(spec, Mapping):
        fields = dict(spec)
        if fields.get("tint") is not None:
            fields["tint"] = tuple(float(v) for v in fields["tint"])
        try:
            return SiteStyle(**fields)
        except TypeError:
            unknown = sorted(set(fields) - set(_FIELDS))
            raise ValueError(f"site style {spec!r}: unknown parameter(s) {unknown}; known: {_FIELDS}") from None
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a site style is a name, name+key=value or a mapping of {_FIELDS}; got {spec!r}")
    style = SiteStyle()
    for part in (p.strip() for p in spec.split("+")):
        if "=" in part:
            key, _, value = (t.strip() for t in part.partition("="))
            try:
                style = dataclasses.replace(style, **{key: _parse_value(key, value, spec)})
            except ValueError as err:  # out of range: SiteStyle names the parameter, we add the entry
                raise ValueError(
                    str(err) if str(err).startswith("site style") else f"site style {spec!r}: {err}"
                ) from None
        elif part == RANDOM_STYLE:
            style = _random_style(np.random.default_rng(stable_seed(seed, "site_style", site)))
        elif part in NAMED_STYLES:
            style = dataclasses.replace(style, **NAMED_STYLES[part])
        else:
            names = ", ".join([*NAMED_STYLES, RANDOM_STYLE])
            raise ValueError(f"site style {spec!r}: unknown style {part!r}; named styles: {names}")
    return style


_FIELDS = tuple(f.name for f in dataclasses.fields(SiteStyle))


def _parse_value(key: str, value: str, spec: str) -> float | bool | tuple[float, ...]:
    """The value of one ``key=value`` part (``invert=true``, ``tint=1/0.8/0.8``, numbers otherwise)."""
    if key not in _FIELDS:
        raise ValueError(f"site style {spec!r}: unknown parameter {key!r}; known: {', '.join(_FIELDS)}")
    try:
        if key == "invert":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if key == "tint":
            return tuple(float(v) for v in value.split("/"))
        return float(value)
    except ValueError:
        raise ValueError(f"site style {spec!r}: cannot read {key}={value!r}") from None


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


# ------------------------------------------------------------------------------------------ modality-true styles

# Degree of the bias field's Legendre polynomial (MONAI's RandBiasField default): (3 + 1)(3 + 2) / 2 = 10 terms.
BIAS_FIELD_DEGREE = 3

# Stain vectors of haematoxylin, eosin and DAB (rows: the RGB optical density of one unit of each stain), from
# A. C. Ruifrok and D. A. Johnston, "Quantification of histochemical staining by color deconvolution", Analytical
# and Quantitative Cytology and Histology 23(4):291-299, 2001; the matrix scikit-image's ``rgb2hed`` uses
# (``skimage.color.rgb_from_hed``). Optical densities are row vectors: ``od = hed @ RGB_FROM_HED``.
RGB_FROM_HED = np.array([[0.65, 0.70, 0.29], [0.07, 0.99, 0.11], [0.27, 0.57, 0.78]])
HED_FROM_RGB = np.linalg.inv(RGB_FROM_HED)
# Intensities are floored here before the logarithm (as scikit-image does), so black maps to a finite density.
_MIN_INTENSITY = 1e-6


@dataclass(frozen=True)
class SiteDraws:
    """The per-site random parameters of a style's modality-true steps, drawn from the site's seed.

    Each step draws from its own generator (``stable_seed(seed, "<step>")``), so adding one step to a style does not
    change the others' draws. A field is ``None`` when its step is off.

    Attributes:
        bias_coefficients: The bias field's 10 Legendre coefficients, in MONAI's order (``np.tril_indices(4)`` of
            the coefficient matrix: ``(0, 0), (1, 0), (1, 1), (2, 0), ...``, row: degree along the height).
        spike: The k-space spike's ``(row, column, amplitude)``: its position in the centred (``fftshift``-ed)
            spectrum and the stripe amplitude ``a`` (magnitude ``a * H * W``).
        stain_scale: Factors of the haematoxylin, eosin and DAB densities.
        stain_shift: Offsets added to them (optical density units).

    """

    bias_coefficients: tuple[float, ...] | None = None
    spike: tuple[int, int, float] | None = None
    stain_scale: tuple[float, float, float] | None = None
    stain_shift: tuple[float, float, float] | None = None


def site_draws(style: SiteStyle, seed: int, height: int, width: int) -> SiteDraws:
    """Draws the site's bias field coefficients, k-space spike and stain factors (what :func:`apply_style` uses).

    Args:
        style: The site's style; only the steps it turns on are drawn.
        seed: The site's seed (the one given to :func:`apply_style`).
        height: Image height (the spike's row is drawn in ``range(height)``).
        width: Image width.

    Returns:
        The draws; the same arguments always give the same draws.

    """
    coefficients = spike = scale = shift = None
    if style.bias_field > 0:
        rng = np.random.default_rng(stable_seed(seed, "bias_field"))
        n = (BIAS_FIELD_DEGREE + 1) * (BIAS_FIELD_DEGREE + 2) // 2
        coefficients = tuple(float(v) for v in rng.uniform(-style.bias_field, style.bias_field, n))
    if style.kspace_spikes > 0:
        rng = np.random.default_rng(stable_seed(seed, "kspace_spikes"))
        centre = (height // 2) * width + width // 2  # the zero frequency after fftshift
        flat = int(rng.integers(0, max(height * width - 1, 1)))
        flat += int(height * width > 1 and flat >= centre)  # skip the centre: a spike there is a global gain
        amplitude = float(rng.uniform(0.5, 1.0)) * style.kspace_spikes
        spike = (flat // width, flat % width, amplitude)
    if style.stain_he > 0:
        rng = np.random.default_rng(stable_seed(seed, "stain_he"))
        h, e, d = (float(v) for v in rng.uniform(1.0 - style.stain_he, 1.0 + style.stain_he, 3))
        scale = (h, e, d)
        h, e, d = (float(v) for v in rng.uniform(-style.stain_he, style.stain_he, 3))
        shift = (h, e, d)
    return SiteDraws(bias_coefficients=coefficients, spike=spike, stain_scale=scale, stain_shift=shift)


def log_bias_field(coefficients: Sequence[float], height: int, width: int) -> np.ndarray:
    """The log bias field ``f`` (the image is multiplied by ``exp(f)``), as MONAI's ``RandBiasField`` builds it.

    ``f(y, x) = sum c_ij P_i(y) P_j(x)`` over ``j <= i <= 3``, ``P_k`` the Legendre polynomials, ``y`` and ``x`` on
    evenly spaced points of [-1, 1] along the height and the width.

    Args:
        coefficients: The 10 coefficients in ``np.tril_indices(4)`` order (see :class:`SiteDraws`).
        height: Field height.
        width: Field width.

    Returns:
        A float64 (height, width) array.

    """
    matrix = np.zeros((BIAS_FIELD_DEGREE + 1, BIAS_FIELD_DEGREE + 1))
    matrix[np.tril_indices(BIAS_FIELD_DEGREE + 1)] = coefficients
    ys = np.linspace(-1.0, 1.0, height, dtype=np.float32)
    xs = np.linspace(-1.0, 1.0, width, dtype=np.float32)
    return np.polynomial.legendre.leggrid2d(ys, xs, matrix)


def _centred_fft(x: torch.Tensor) -> torch.Tensor:
    return torch.fft.fftshift(torch.fft.fft2(x), dim=(-2, -1))


def _inverse_centred_fft(k: torch.Tensor) -> torch.Tensor:
    return torch.fft.ifft2(torch.fft.ifftshift(k, dim=(-2, -1))).real


def _gibbs(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Keeps k-space within radius ``(1 - alpha) * max(H, W) * sqrt(2) / 2`` of the centre (MONAI's mask)."""
    height, width = x.shape[-2:]
    radius = (1.0 - alpha) * max(height, width) * np.sqrt(2) / 2.0
    rows = np.arange(height)[:, None] - (height - 1) / 2
    cols = np.arange(width)[None, :] - (width - 1) / 2
    mask = torch.as_tensor(np.sqrt(rows**2 + cols**2) <= radius, device=x.device)
    return _inverse_centred_fft(_centred_fft(x) * mask).to(x.dtype)


def _kspace_spike(x: torch.Tensor, row: int, col: int, amplitude: float) -> torch.Tensor:
    """Sets the magnitude of k-space point (row, col) of every image and channel to ``amplitude * H * W``."""
    k = _centred_fft(x)
    phase = torch.angle(k[..., row, col])
    k[..., row, col] = torch.polar(torch.full_like(phase, amplitude * x.shape[-2] * x.shape[-1]), phase)
    return _inverse_centred_fft(k).to(x.dtype)


def _rician(x: torch.Tensor, relative_std: float, seed: int) -> torch.Tensor:
    """``sqrt((x + n1)² + n2²)``, ``n1``, ``n2`` ~ N(0, (relative_std * std of each image)²), seeded."""
    generator = torch.Generator().manual_seed(stable_seed(seed, "rician_noise"))
    noise = torch.randn((2, *x.shape), generator=generator, dtype=x.dtype).to(x.device)
    # The unbiased std, as MONAI's ``img.std()``; 0 for a one-pixel image (whose std is undefined).
    std = relative_std * x.flatten(1).std(dim=1).nan_to_num(0.0).view(-1, 1, 1, 1)
    return torch.sqrt((x + std * noise[0]) ** 2 + (std * noise[1]) ** 2)


def rgb_to_hed(images: torch.Tensor) -> torch.Tensor:
    """Haematoxylin, eosin and DAB optical densities of an (N, 3, H, W) RGB batch in [0, 1] (colour deconvolution).

    ``hed = -ln(max(rgb, 1e-6)) @ HED_FROM_RGB`` per pixel, computed in float64. Unlike scikit-image's
    ``rgb2hed``, the densities are neither divided by ``-ln(1e-6)`` nor clipped at 0, so :func:`hed_to_rgb` undoes
    this exactly.

    Args:
        images: RGB images.

    Returns:
        A float64 (N, 3, H, W) tensor of densities (channel 0 haematoxylin, 1 eosin, 2 DAB).

    """
    density = -torch.log(images.double().clamp_min(_MIN_INTENSITY))
    return torch.einsum("nchw,cs->nshw", density, torch.as_tensor(HED_FROM_RGB, device=images.device))


def hed_to_rgb(hed: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 1] of (N, 3, H, W) stain densities: ``exp(-hed @ RGB_FROM_HED)``, clipped to [0, 1].

    Args:
        hed: Densities as :func:`rgb_to_hed` returns them.

    Returns:
        A float64 (N, 3, H, W) RGB tensor.

    """
    density = torch.einsum("nshw,sc->nchw", hed.double(), torch.as_tensor(RGB_FROM_HED, device=hed.device))
    return torch.exp(-density).clamp(0.0, 1.0)


def _stain_jitter(x: torch.Tensor, scale: Sequence[float], shift: Sequence[float]) -> torch.Tensor:
    factors = torch.tensor(scale, dtype=torch.float64, device=x.device).view(1, 3, 1, 1)
    offsets = torch.tensor(shift, dtype=torch.float64, device=x.device).view(1, 3, 1, 1)
    return hed_to_rgb(rgb_to_hed(x) * factors + offsets).to(x.dtype)


def apply_style(images: torch.Tensor, style: SiteStyle, seed: int) -> torch.Tensor:
    """Applies a site style to a batch of images; pure: the same inputs and seed give the same output.

    Order: H&E stain jitter (3 channels only), bias field, Gibbs ringing, k-space spike, Rician noise, then
    contrast around 0.5, gamma, gain, Gaussian blur, tint (3 channels only), additive noise, inversion, clamp to
    [0, 1]. Steps whose parameter is the identity are skipped, so ``SiteStyle()`` returns an exact copy. The
    bias field, spike and stain factors are drawn from ``seed`` (:func:`site_draws`) and shared by the whole
    batch; the Gibbs, k-space and bias steps act on every channel alike.

    Args:
        images: Float tensor (N, C, H, W) with values in [0, 1]. Not modified.
        style: The style to apply.
        seed: The site's seed: of the private generators of the noises and of the per-site draws.

    Returns:
        A new float tensor of the same shape with values in [0, 1].

    Raises:
        ValueError: If ``images`` is not a 4-D floating-point tensor, or ``style`` has ``stain_he`` and the
            images do not have 3 channels.

    """
    if images.ndim != 4 or not images.is_floating_point():
        raise ValueError(f"apply_style expects a float (N, C, H, W) tensor, got {images.dtype} {tuple(images.shape)}")
    if style.stain_he > 0 and images.shape[1] != 3:
        raise ValueError(
            f"site style stain_he (H&E stain variation) needs 3-channel RGB images, got {images.shape[1]} "
            f"channel(s); use it for histology colour images (e.g. channels=3), not gray scans"
        )
    x = images.clone()
    draws = site_draws(style, seed, images.shape[2], images.shape[3])
    if x.numel():
        if draws.stain_scale is not None and draws.stain_shift is not None:
            x = _stain_jitter(x, draws.stain_scale, draws.stain_shift)
        if draws.bias_coefficients is not None:
            field = torch.as_tensor(log_bias_field(draws.bias_coefficients, x.shape[2], x.shape[3]), device=x.device)
            x = (x.double() * torch.exp(field)).to(x.dtype)
        if style.gibbs > 0:
            x = _gibbs(x, style.gibbs)
        if draws.spike is not None:
            x = _kspace_spike(x, *draws.spike)
        if style.rician_noise > 0:
            x = _rician(x, style.rician_noise, seed)
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


def style_name(site_styles: Any, index: int) -> str:
    """A short name of style ``index`` of a datamodule's ``site_styles`` argument (``true`` or a list of specs)."""
    if site_styles is True:
        return DEFAULT_SITE_SEQUENCE[index] if index < len(DEFAULT_SITE_SEQUENCE) else "random style"
    try:
        spec = site_styles[index]
    except (IndexError, KeyError, TypeError):
        return f"style {index}"
    if isinstance(spec, SiteStyle):
        default = SiteStyle()
        spec = {k: v for k, v in vars(spec).items() if v != getattr(default, k)}
    if isinstance(spec, Mapping):
        return "+".join(f"{k}={v}" for k, v in spec.items()) or "clean"
    return str(spec)
