"""FedER's privacy audit: how close each node's generator comes to each of its real training images.

For every real training image x of every node, the LPIPS distance to its closest synthetic image, found two
ways: the closest of a large generated sample (all labels), and by optimising the latent code z of G(z, y_x)
to match x (starting from the best code of the sample). The same is measured for generators trained without
the privacy term (α = 0), and for each real image's closest *other* real image of the node (the scale of
"close"). A histogram (PNG) and the numbers (JSON) go to the run directory::

    python -m callbacks.feder.privacy_audit --run runs/<feder run> [--reference <run trained with alpha 0>]

Without ``--reference``, α = 0 generators are trained with the run's own settings and seeds into
``<out>/generators_no_privacy/`` (reused when present; also usable as ``ExperienceReplay.generators_from``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from callbacks.feder.experience_replay import ExperienceReplay  # noqa: E402
from callbacks.feder.generator_store import (  # noqa: E402
    GENERATORS_DIR,
    data_digest,
    generator_path,
    load_node_gan,
    save_node_gan,
)
from callbacks.feder.perceptual import PerceptualDistance  # noqa: E402
from callbacks.feder.private_gan import train_node_gan  # noqa: E402
from callbacks.feder.replay import draw_codes, generate  # noqa: E402
from datamodules.base import FederatedDataModule  # noqa: E402
from datamodules.sampler import stable_seed  # noqa: E402
from fl_lightning.outputs.run_dir import atomic_write_text, json_safe  # noqa: E402


def closest_by_latent_search(
    distance: PerceptualDistance,
    generator: nn.Module,
    targets: Tensor,
    labels: Tensor,
    start: Tensor,
    steps: int,
    lr: float = 0.05,
) -> Tensor:
    """Smallest LPIPS(G(z, y), x) found by Adam on z from ``start``, per target (the best of the trajectory).

    Args:
        distance: The LPIPS module.
        generator: The node's generator (frozen here).
        targets: Real images (N, C, H, W).
        labels: Their labels (N,), the generator's condition.
        start: Initial codes (N, latent_dim).
        steps: Adam steps on all codes at once.
        lr: Adam learning rate.

    """
    generator.eval().requires_grad_(False)  # only the codes are optimised
    z = start.clone().requires_grad_(True)
    opt = torch.optim.Adam([z], lr=lr)
    best = torch.full((len(targets),), math.inf)
    for _ in range(steps + 1):
        d = distance(generator(z, labels), targets)
        best = torch.minimum(best, d.detach())
        if not d.requires_grad:  # a generator that ignores its code continuously (e.g. a lookup): nothing to search
            break
        opt.zero_grad(set_to_none=True)
        d.sum().backward()  # each code only affects its own term
        opt.step()
    return best


def audit_node(
    distance: PerceptualDistance,
    generator: nn.Module,
    real: Tensor,
    labels: Tensor,
    samples: int,
    latent_steps: int,
    seed: int,
) -> dict[str, Tensor]:
    """Per real image: distance to the closest of ``samples`` generated images, and after latent search."""
    latents, sample_labels = draw_codes(labels, samples, generator.latent_dim, seed)
    d = distance.matrix(real, generate(generator, latents, sample_labels))
    by_sample = d.min(dim=1).values
    # Each search starts from the closest sampled code generated for the image's own label (the condition it
    # is searched under); an image whose label the sample lacks starts from its overall closest code.
    same = sample_labels[None, :] == labels[:, None]
    start = torch.where(same.any(dim=1), d.masked_fill(~same, math.inf).argmin(dim=1), d.argmin(dim=1))
    by_latent = closest_by_latent_search(distance, generator, real, labels, latents[start], latent_steps)
    return {"sample": by_sample, "latent": torch.minimum(by_latent, by_sample)}


def real_to_real(distance: PerceptualDistance, real: Tensor) -> Tensor:
    """Per real image, the distance to its closest other real image of the same node (the scale of 'close')."""
    closest = distance.matrix(real, real).fill_diagonal_(math.inf).min(dim=1).values
    return closest[torch.isfinite(closest)]  # a node with a single image has no other


def summarise(values: Tensor, bins: np.ndarray) -> dict[str, Any]:
    """Mean, quantiles and histogram counts of a distance distribution."""
    v = values.numpy()
    q = np.quantile(v, [0.0, 0.05, 0.25, 0.5, 0.75])
    return {
        "n": int(len(v)), "mean": float(v.mean()), "min": float(q[0]), "p05": float(q[1]), "p25": float(q[2]),
        "median": float(q[3]), "p75": float(q[4]), "histogram": np.histogram(v, bins=bins)[0].tolist(),
    }  # fmt: skip


def load_run(run: Path) -> tuple[FederatedDataModule, ExperienceReplay]:
    """The datamodule and the FedER callback of a run, rebuilt from its resolved ``config.yaml``."""
    from fl_lightning.cli import build_cli

    config = run / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{run} is not a run directory: {config} is missing")
    with warnings.catch_warnings():  # LightningCLI warns when sys.argv (this command's own flags) is also set
        warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter.*")
        cli = build_cli(["--config", str(config), "--trainer.logger=false"])
    replay = [cb for cb in cli.trainer.callbacks if isinstance(cb, ExperienceReplay)]
    if not replay:
        raise ValueError(f"{config} has no callbacks.ExperienceReplay: not a FedER run")
    return cli.datamodule, replay[0]


def generator_set(directory: Path, data: FederatedDataModule, replay: ExperienceReplay) -> dict[str, Any]:
    """Each node's generator from a generators directory, checked against the node's data."""
    out: dict[str, Any] = {}
    for node in data.client_ids:
        split, path = data.client_data(node), generator_path(directory, node)
        stored = load_node_gan(path)
        if stored["fingerprint"].get("data") != data_digest(split.train_x, split.train_y):
            raise ValueError(f"node {node!r}: {path} was trained on other data than this run's")
        generator = replay.make_generator(data.num_classes, data.in_channels, tuple(data.image_size))
        generator.load_state_dict(stored["generator"])
        out[node] = (generator.eval(), float(stored["fingerprint"].get("gan", {}).get("privacy_weight", math.nan)))
    return out


def train_reference(directory: Path, data: FederatedDataModule, replay: ExperienceReplay) -> Path:
    """α = 0 generators with the run's settings and seeds (kept in ``directory`` and reused when present)."""
    config = dataclasses.replace(replay.gan, privacy_weight=0.0)
    for node in data.client_ids:
        path = generator_path(directory, node)
        if path.is_file():
            continue
        split = data.client_data(node)
        print(f"training the alpha = 0 reference generator of node {node!r}", flush=True)
        stored = train_node_gan(
            node, split.train_x, split.train_y, data.num_classes, config, replay.buffer_size,
            make_generator=replay.make_generator, make_discriminator=replay.make_discriminator,
        )  # fmt: skip
        fingerprint = {"node": node, "data": data_digest(split.train_x, split.train_y), "num_classes": data.num_classes,
                       "buffer_size": replay.buffer_size, "gan": dataclasses.asdict(config)}  # fmt: skip
        save_node_gan(path, **stored, fingerprint=fingerprint)
    return directory


def plot(results: dict[str, Any], bins: np.ndarray, path: Path) -> None:
    """One panel per search (sampling, latent optimisation): a histogram per generator set, plus real → real."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    centres = (bins[:-1] + bins[1:]) / 2
    for ax, search in zip(axes, ("sample", "latent")):
        for name, entry in results["sets"].items():
            ax.stairs(entry[search]["histogram"], bins, label=f"{name} (median {entry[search]['median']:.3f})", lw=2)
        ref = results["real_to_real"]
        ax.plot(centres, ref["histogram"], "k--", lw=1, label=f"closest other real image (median {ref['median']:.3f})")
        title = "closest of the generated sample" if search == "sample" else "latent code optimised to match"
        ax.set(title=f"real image → {title}", xlabel="LPIPS distance", ylabel="real training images")
        ax.legend(fontsize=8)
    backbone = "ImageNet" if results["lpips"]["pretrained_backbone"] else "RANDOM"
    fig.suptitle(f"FedER privacy audit (LPIPS {results['lpips']['net']}, {backbone} backbone)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def audit(
    run: Path,
    reference: Path | None = None,
    out: Path | None = None,
    samples: int = 2000,
    latent_steps: int = 50,
    max_real: int | None = None,
    bins: int = 40,
) -> dict[str, Any]:
    """Run the audit on a FedER run directory; writes ``privacy_audit.json`` and ``privacy_audit.png`` to ``out``.

    Args:
        run: The FedER run directory (its ``config.yaml`` and ``generators/``).
        reference: A run (or generators directory) trained with α = 0 on the same data; ``None`` trains one.
        out: Output directory (default: ``run``).
        samples: Generated images searched per node.
        latent_steps: Adam steps of the latent search.
        max_real: Audit at most this many real images per node (default: all).
        bins: Histogram bins.

    Returns:
        What ``privacy_audit.json`` holds.

    """
    run = Path(run)
    out = Path(out) if out else run
    data, replay = load_run(run)
    distance = replay.gan.build_distance()
    if reference is None:
        reference = train_reference(out / "generators_no_privacy", data, replay)
    ref_dir = Path(reference) / GENERATORS_DIR if (Path(reference) / GENERATORS_DIR).is_dir() else Path(reference)
    sets = {"run": generator_set(run / GENERATORS_DIR, data, replay), "reference": generator_set(ref_dir, data, replay)}
    raw: dict[str, dict[str, list[Tensor]]] = {}
    closest_real: list[Tensor] = []
    for node in data.client_ids:
        split = data.client_data(node)
        real, labels = split.train_x[:max_real], split.train_y[:max_real]
        closest_real.append(real_to_real(distance, real))
        for key, generators in sets.items():
            generator, _ = generators[node]
            found = audit_node(distance, generator, real, labels, samples, latent_steps, stable_seed(0, "audit", node))
            for search, values in found.items():
                raw.setdefault(key, {}).setdefault(search, []).append(values)
    all_values = torch.cat([torch.cat(v) for s in raw.values() for v in s.values()] + closest_real)
    edges = np.linspace(0.0, float(all_values.max()) * 1.02 + 1e-6, bins + 1)
    results: dict[str, Any] = {
        "run": str(run), "reference": str(ref_dir), "samples": samples, "latent_steps": latent_steps,
        "lpips": {"net": distance.net_name, "pretrained_backbone": distance.pretrained_backbone},
        "bins": edges.tolist(), "real_to_real": summarise(torch.cat(closest_real), edges), "sets": {},
    }  # fmt: skip
    for key, searches in raw.items():
        alpha = next(iter(sets[key].values()))[1]
        name = f"{'with' if alpha else 'without'} L_PP (alpha = {alpha:g})"
        name = name if name not in results["sets"] else f"{name}, {key}"  # two sets trained alike stay apart
        results["sets"][name] = {"privacy_weight": alpha, "source": key}
        results["sets"][name].update({s: summarise(torch.cat(v), edges) for s, v in searches.items()})
        results["sets"][name]["per_node"] = {
            node: {s: float(v[i].mean()) for s, v in searches.items()} for i, node in enumerate(data.client_ids)
        }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "privacy_audit.json", json.dumps(json_safe(results), indent=2) + "\n")
    plot(results, edges, out / "privacy_audit.png")
    return results


def main(args: list[str] | None = None) -> dict[str, Any]:
    """``python -m callbacks.feder.privacy_audit --run <dir>``; returns what the JSON holds."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="FedER run directory")
    parser.add_argument("--reference", type=Path, help="run or generators directory trained with alpha = 0")
    parser.add_argument("--out", type=Path, help="output directory (default: the run directory)")
    parser.add_argument("--samples", type=int, default=2000, help="generated images searched per node")
    parser.add_argument("--latent-steps", type=int, default=50, help="Adam steps of the latent search")
    parser.add_argument("--max-real", type=int, help="audit at most this many real images per node")
    ns = parser.parse_args(args)
    results = audit(ns.run, ns.reference, ns.out, ns.samples, ns.latent_steps, ns.max_real)
    for name, entry in results["sets"].items():
        print(f"{name}: median closest LPIPS {entry['sample']['median']:.4f} (sample), "
              f"{entry['latent']['median']:.4f} (latent search)")  # fmt: skip
    print(f"real -> closest other real: median {results['real_to_real']['median']:.4f}")
    print(f"wrote {(ns.out or ns.run) / 'privacy_audit.json'} and privacy_audit.png")
    return results


if __name__ == "__main__":
    main()
