"""A small class-conditional DCGAN (generator and projection discriminator) sized for the data.

FedER trains one per node before the federation; both are replaceable through the config
(``callbacks.ExperienceReplay(generator=..., discriminator=...)``): any module with the same
constructor head ``(num_classes, channels, image_size, ...)`` and the call contracts below works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm


def _check_size(image_size: tuple[int, int], name: str) -> tuple[int, int]:
    h, w = (int(s) for s in image_size)
    if h < 4 or w < 4 or h % 4 or w % 4:
        raise ValueError(
            f"{name} needs an image size divisible by 4 (two 2x up/down-sampling blocks), got {image_size}"
        )
    return h, w


class ConditionalGenerator(nn.Module):
    """DCGAN generator conditioned on the class: [z, one-hot(y)] → linear → two 2× transposed-conv blocks.

    Contract: ``latent_dim`` attribute; ``forward(z, y)`` maps latent codes (N, latent_dim) and labels
    (N,) to images (N, C, H, W) in [0, 1] (the data's range, so synthetic and real images are interchangeable).

    Args:
        num_classes: Number of classes the generator is conditioned on.
        channels: Image channels.
        image_size: Output (height, width); both divisible by 4.
        latent_dim: Size of the latent code z.
        width: Channels of the last hidden block (the first has twice as many).

    """

    def __init__(
        self, num_classes: int, channels: int, image_size: tuple[int, int], latent_dim: int = 32, width: int = 32
    ) -> None:
        super().__init__()
        h, w = _check_size(image_size, "ConditionalGenerator")
        self.num_classes, self.latent_dim = num_classes, latent_dim
        self._start = (2 * width, h // 4, w // 4)
        self.project = nn.Sequential(
            nn.Linear(latent_dim + num_classes, 2 * width * (h // 4) * (w // 4), bias=False),
            nn.BatchNorm1d(2 * width * (h // 4) * (w // 4)),
            nn.ReLU(inplace=True),
        )
        self.blocks = nn.Sequential(
            nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.ConvTranspose2d(width, channels, 4, stride=2, padding=1),
            nn.Sigmoid(),
        )

    def forward(self, z: Tensor, y: Tensor) -> Tensor:
        """Images (N, C, H, W) in [0, 1] for latent codes ``z`` (N, latent_dim) and labels ``y`` (N,)."""
        onehot = F.one_hot(y, self.num_classes).to(z.dtype)
        return self.blocks(self.project(torch.cat([z, onehot], dim=1)).view(len(z), *self._start))


class ConditionalDiscriminator(nn.Module):
    """Projection discriminator (Miyato & Koyama, 2018) with spectral normalisation: two strided conv blocks.

    Contract: ``forward(x, y)`` maps images (N, C, H, W) in [0, 1] and labels (N,) to real/fake logits (N,).

    Args:
        num_classes: Number of classes.
        channels: Image channels.
        image_size: Input (height, width); both divisible by 4.
        width: Channels of the first block (the second has twice as many).

    """

    def __init__(self, num_classes: int, channels: int, image_size: tuple[int, int], width: int = 32) -> None:
        super().__init__()
        h, w = _check_size(image_size, "ConditionalDiscriminator")
        self.features = nn.Sequential(
            spectral_norm(nn.Conv2d(channels, width, 4, stride=2, padding=1)),
            nn.LeakyReLU(0.2, inplace=True),
            spectral_norm(nn.Conv2d(width, 2 * width, 4, stride=2, padding=1)),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Flatten(),
        )
        hidden = 2 * width * (h // 4) * (w // 4)
        self.linear = spectral_norm(nn.Linear(hidden, 1))
        self.embed = spectral_norm(nn.Embedding(num_classes, hidden))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Logits (N,): ψ(φ(x)) + ⟨embed(y), φ(x)⟩, on images rescaled to [-1, 1]."""
        h = self.features(2 * x - 1)
        return self.linear(h).squeeze(1) + (self.embed(y) * h).sum(dim=1)
