"""FedER's first phase on every node: a class-conditional GAN trained on the node's private data with L_PP.

A short two-optimiser loop in plain PyTorch rather than a second Lightning Trainer: it runs once per node
before round 1, alternates a discriminator and a generator step on the same batch, and has no evaluation,
logging or checkpointing of its own (its result, the generator, is saved in the run directory by the caller).
Everything it draws comes from its own seed, inside ``torch.random.fork_rng``, so the federation's RNG streams
are the same whether the GANs were trained in this process or loaded from disk (exact resume).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from callbacks.feder.gan import ConditionalDiscriminator, ConditionalGenerator
from callbacks.feder.perceptual import PerceptualDistance
from callbacks.feder.replay import draw_codes, generate
from datamodules.sampler import stable_seed
from fl_lightning.ops.privacy import discriminator_loss, generator_loss

# (num_classes, channels, (height, width)) → module; jsonargparse builds these from a class_path + init_args.
GeneratorFactory = Callable[[int, int, tuple[int, int]], nn.Module]
DiscriminatorFactory = Callable[[int, int, tuple[int, int]], nn.Module]


@dataclass
class PrivateGANConfig:
    """Settings of the privacy-preserving conditional GAN each node trains before the federation.

    Args:
        epochs: Training budget in passes over the node's data: ``ceil(epochs · n / batch_size)`` steps, so
            tiny data (tests) trains in a few steps and the digits (≈ 480 images per node, batch 64) in 300.
        batch_size: Real (and generated) images per step.
        lr: Adam learning rate of both networks (1e-3: five times DCGAN's 2e-4, which needed ~3x the steps on the
            digits for the same quality of synthetic data).
        beta1: Adam β₁ (0.5, the DCGAN choice).
        privacy_weight: α, the weight of L_PP in the generator loss (0: a plain GAN, no privacy term).
        privacy_pairs: L_PP is averaged over the first ``privacy_pairs`` generated × real images of the batch
            (an unbiased estimate of the full pairwise mean at a fraction of the LPIPS cost).
        lpips_net: LPIPS backbone (``alex``, ``vgg`` or ``squeeze``).
        lpips_weights: Path to the backbone's torchvision ImageNet weights; ``None`` uses the torch hub cache
            if the file is there, otherwise a random backbone (with a warning).
        lpips_size: Side images are resized to for LPIPS (the backbones need ≥ 32 px).
        seed: Seed of the GAN phase; each node's stream is derived from it and the node id.

    """

    epochs: float = 40.0
    batch_size: int = 64
    lr: float = 1e-3
    beta1: float = 0.5
    privacy_weight: float = 1.0
    privacy_pairs: int = 16
    lpips_net: str = "alex"
    lpips_weights: str | None = None
    lpips_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "epochs": self.epochs > 0,
            "batch_size": self.batch_size >= 1,
            "lr": self.lr > 0,
            "beta1": 0 <= self.beta1 < 1,
            "privacy_weight": self.privacy_weight >= 0,
            "privacy_pairs": self.privacy_pairs >= 1,
            "lpips_size": self.lpips_size >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                "invalid ExperienceReplay gan settings: " + ", ".join(f"gan.{k}={getattr(self, k)!r}" for k in bad)
            )

    def num_steps(self, num_samples: int) -> int:
        """Optimiser steps for a node with ``num_samples`` training images (at least one)."""
        return max(1, math.ceil(self.epochs * num_samples / self.batch_size))

    def build_distance(self) -> PerceptualDistance:
        """The LPIPS module of these settings (no download; see :class:`PerceptualDistance`)."""
        return PerceptualDistance(self.lpips_net, self.lpips_weights, self.lpips_size)


def train_private_gan(
    images: Tensor,
    labels: Tensor,
    num_classes: int,
    config: PrivateGANConfig,
    seed: int,
    distance: PerceptualDistance | None = None,
    make_generator: GeneratorFactory = ConditionalGenerator,
    make_discriminator: DiscriminatorFactory = ConditionalDiscriminator,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Train a conditional generator on one node's images with L_G = non-saturating loss + α·L_PP.

    Each step draws a real batch (with replacement), generates as many images for the same labels, takes a
    discriminator step on (real, detached fake), then a generator step on the fake batch.

    Args:
        images: The node's training images (N, C, H, W) in [0, 1].
        labels: Their labels (N,).
        num_classes: Classes of the task (the generator's conditioning size).
        config: Budget, optimiser and privacy settings.
        seed: Seed of this node's GAN phase (network initialisation, batches, latent codes).
        distance: LPIPS module (built from ``config`` when needed and not given).
        make_generator: Builds the generator from ``(num_classes, channels, (H, W))``.
        make_discriminator: Builds the discriminator from the same arguments.
        device: Where to train.

    Returns:
        The trained generator, in eval mode, on the CPU.

    """
    if len(images) == 0:
        raise ValueError("train_private_gan needs at least one image")
    alpha = config.privacy_weight
    if alpha and distance is None:
        distance = config.build_distance()
    device = torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        shape = (int(images.shape[2]), int(images.shape[3]))
        generator = make_generator(num_classes, int(images.shape[1]), shape).to(device).train()
        discriminator = make_discriminator(num_classes, int(images.shape[1]), shape).to(device).train()
        if distance is not None:
            distance = distance.to(device)
        betas = (config.beta1, 0.999)
        opt_g = torch.optim.Adam(generator.parameters(), lr=config.lr, betas=betas)
        opt_d = torch.optim.Adam(discriminator.parameters(), lr=config.lr, betas=betas)
        images, labels = images.to(device), labels.to(device)
        k = config.privacy_pairs
        for _ in range(config.num_steps(len(images))):
            idx = torch.randint(len(images), (config.batch_size,), device=device)
            real, y = images[idx], labels[idx]
            fake = generator(torch.randn(len(y), generator.latent_dim, device=device), y)

            d_loss = discriminator_loss(discriminator(real, y), discriminator(fake.detach(), y))
            opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            opt_d.step()

            distances = distance.pairwise(fake[:k], real[:k]) if alpha else None
            g_loss = generator_loss(discriminator(fake, y), distances, alpha)
            opt_g.zero_grad(set_to_none=True)
            g_loss.backward()
            opt_g.step()
    return generator.eval().cpu()


def train_node_gan(
    node: str,
    images: Tensor,
    labels: Tensor,
    num_classes: int,
    config: PrivateGANConfig,
    buffer_size: int,
    distance: PerceptualDistance | None = None,
    make_generator: GeneratorFactory = ConditionalGenerator,
    make_discriminator: DiscriminatorFactory = ConditionalDiscriminator,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor | dict[str, Tensor]]:
    """A node's whole GAN phase: train its generator, then draw its buffer (codes, labels, images).

    Seeds derive from ``config.seed`` and the node id only, so the same node data and settings give the same
    generator and buffer in any run (the privacy audit retrains its α = 0 reference this way).

    Args:
        node: The node's id.
        images: Its training images (N, C, H, W) in [0, 1].
        labels: Their labels (N,); the buffer's labels are drawn from them (the node's label mix).
        num_classes: Classes of the task.
        config: GAN settings.
        buffer_size: Entries of the buffer.
        distance: LPIPS module (built from ``config`` when needed and not given).
        make_generator: Generator factory.
        make_discriminator: Discriminator factory.
        device: Where to train.

    Returns:
        ``{"generator": state_dict, "latents": (B, latent_dim), "labels": (B,), "images": (B, C, H, W)}``.

    """
    generator = train_private_gan(
        images, labels, num_classes, config, seed=stable_seed(config.seed, "gan", node), distance=distance,
        make_generator=make_generator, make_discriminator=make_discriminator, device=device,
    )  # fmt: skip
    latents, codes_labels = draw_codes(
        labels, buffer_size, generator.latent_dim, stable_seed(config.seed, "buffer", node)
    )
    return {
        "generator": generator.state_dict(),
        "latents": latents,
        "labels": codes_labels,
        "images": generate(generator, latents, codes_labels),
    }
