"""What HarmoFL's amplitude swap does to the images, per band: thin structures, site differences and colour.

For each embedded task's five styled sites, the shared amplitude is what AmplitudeNormalization exchanges after
round 1 (the uniform mean of the sites' mean amplitudes); every training image then keeps its own phase and takes
the shared amplitude inside the band window (``band`` 0: the mean intensity only, as the released code does; 1:
the whole spectrum, as the paper). Measured per band, over all sites' images:

- ``structure``: Pearson correlation of each image with itself after the swap (1 = the image is unchanged up to
  brightness and contrast);
- ``mask contrast`` (segmentation): (mean inside the masks − mean outside) after over before, per image: how much
  of a thin structure's contrast survives;
- ``site spread``: the standard deviation over sites of the site's mean intensity and of its mean per-image
  contrast (std), after over before: what the swap is for (< 1: sites look more alike);
- ``colour`` (RGB digits with the tinted styles): mean cosine between each pixel's RGB vector before and after
  (1 = hues kept).

    python experiments/amplitude_band.py [--out experiments/results/amplitude_band]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from datamodules import DigitsFederated, DigitsSegFederated
from fl_lightning.ops.amplitude import amplitude_phase, band_mask, recompose, replace_amplitude

BANDS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)


def site_images(data) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    data.setup()
    return {c: (data.client_data(c).train_x.float(), data.client_data(c).train_y) for c in data.client_ids}


def swap(images: torch.Tensor, shared: torch.Tensor, band: float) -> torch.Tensor:
    amplitude, phase = amplitude_phase(images)
    mask = band_mask(images.shape[-2], images.shape[-1], band)
    return recompose(replace_amplitude(amplitude, shared, mask), phase)


def correlation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.flatten(1) - a.flatten(1).mean(1, keepdim=True), b.flatten(1) - b.flatten(1).mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-12)


def mask_contrast(images: torch.Tensor, foreground: torch.Tensor) -> torch.Tensor:
    """Per image: the mean intensity inside the masks minus the mean outside."""
    inside = (images * foreground).sum((1, 2, 3)) / foreground.sum((1, 2, 3)).clamp_min(1)
    outside = (images * (1 - foreground)).sum((1, 2, 3)) / (1 - foreground).sum((1, 2, 3)).clamp_min(1)
    return inside - outside


def measure(sites: dict[str, tuple[torch.Tensor, torch.Tensor]], segmentation: bool) -> dict[str, dict[str, float]]:
    shared = torch.stack([amplitude_phase(x)[0].mean(0) for x, _ in sites.values()]).mean(0)
    before_means = torch.tensor([x.mean().item() for x, _ in sites.values()])
    before_stds = torch.tensor([x.flatten(1).std(1).mean().item() for x, _ in sites.values()])
    out = {}
    for band in BANDS:
        row: dict[str, list[float]] = {"structure": [], "mask_contrast": [], "colour": []}
        means, stds = [], []
        for x, y in sites.values():
            z = swap(x, shared, band)
            row["structure"] += correlation(x, z).tolist()
            means.append(z.mean().item())
            stds.append(z.flatten(1).std(1).mean().item())
            if segmentation:
                fg = (y > 0).unsqueeze(1).expand_as(x).float()
                before = mask_contrast(x, fg)
                row["mask_contrast"] += (mask_contrast(z, fg) / before.abs().clamp_min(1e-6) * before.sign()).tolist()
            if x.shape[1] == 3:
                row["colour"] += torch.nn.functional.cosine_similarity(x, z, dim=1).mean((1, 2)).tolist()
        out[str(band)] = {k: sum(v) / len(v) for k, v in row.items() if v}
        out[str(band)]["site_spread_mean"] = torch.tensor(means).std().item() / before_means.std().item()
        out[str(band)]["site_spread_contrast"] = torch.tensor(stds).std().item() / before_stds.std().item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("experiments/results/amplitude_band"))
    args = parser.parse_args()
    results = {
        "digits_seg (24 px, 5 styled sites)": measure(
            site_images(DigitsSegFederated(num_clients=5, image_size=24, num_samples=1000, site_styles=True)), True
        ),
        "digits (16 px, 5 styled sites)": measure(site_images(DigitsFederated(num_clients=5, image_size=16)), False),
        "digits RGB (16 px, tinted sites)": measure(
            site_images(
                DigitsFederated(
                    num_clients=5,
                    image_size=16,
                    channels=3,
                    site_styles=True,  # the fixed sites, each with its own tint
                )
            ),
            False,
        ),  # fmt: skip
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = []
    for task, per_band in results.items():
        keys = list(next(iter(per_band.values())))
        lines += [f"### {task}", "", "| band | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {b} | " + " | ".join(f"{v[k]:.3f}" for k in keys) + " |" for b, v in per_band.items()]
        lines.append("")
    (args.out / "table.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
