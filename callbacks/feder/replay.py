"""FedER's replay buffers and the loaders that put them on the data path of a node's local fit."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from fl_lightning.ops.replay import join_replay

Batch = tuple[Tensor, ...]


@dataclass
class ReplayBuffer:
    """A node's shareable synthetic data: generated images, or latent codes for its generator, with labels.

    Exactly one of ``images`` (the default kind: what travels is the images) and ``generator`` (kind
    ``latents``: the generator and the codes travel, images are generated when drawn) is set.

    Attributes:
        labels: Class of each entry (N,).
        latents: Latent code of each entry (N, latent_dim).
        images: Generated images (N, C, H, W) in [0, 1], or ``None``.
        generator: The node's generator (eval mode, CPU), or ``None``.

    """

    labels: Tensor
    latents: Tensor
    images: Tensor | None = None
    generator: nn.Module | None = None

    def __post_init__(self) -> None:
        if (self.images is None) == (self.generator is None):
            raise ValueError("a ReplayBuffer holds either its images or its generator, not both or neither")

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Images and labels of the entries ``index``."""
        if self.images is not None:
            return self.images[index], self.labels[index]
        return generate(self.generator, self.latents[index], self.labels[index]), self.labels[index]


@torch.no_grad()
def generate(generator: nn.Module, latents: Tensor, labels: Tensor, batch: int = 512) -> Tensor:
    """``generator(latents, labels)`` in eval mode without gradients, in batches; images on the CPU."""
    generator.eval()
    device = next(generator.parameters()).device
    parts = [
        generator(latents[i : i + batch].to(device), labels[i : i + batch].to(device)).cpu()
        for i in range(0, len(labels), batch)
    ]
    return torch.cat(parts) if parts else torch.empty(0)


def draw_codes(label_pool: Tensor, size: int, latent_dim: int, seed: int) -> tuple[Tensor, Tensor]:
    """A fixed pool of ``size`` latent codes and labels, labels drawn from ``label_pool`` (the node's label mix)."""
    g = torch.Generator().manual_seed(seed)
    labels = label_pool[torch.randint(len(label_pool), (size,), generator=g)]
    return torch.randn(size, latent_dim, generator=g), labels


def batch_sizes(loader: DataLoader) -> list[int]:
    """The sizes of the batches one pass of ``loader`` yields, read from its sampler (no data is touched)."""
    n, b = len(loader.sampler), loader.batch_size
    if loader.drop_last:
        return [b] * (n // b)
    return [min(b, n - i) for i in range(0, n, b)]


class BufferBatches:
    """Batches drawn (with replacement) from a buffer, of given sizes: FedER-B's stand-in for the real batches.

    Args:
        buffer: The node's own buffer.
        sizes: Batch sizes of one pass (those of the real loader it replaces).
        seed: Seed of the draws; the stream continues across passes.

    """

    def __init__(self, buffer: ReplayBuffer, sizes: list[int], seed: int) -> None:
        self.buffer, self.sizes = buffer, sizes
        self._rng = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for size in self.sizes:
            yield self.buffer.take(torch.randint(len(self.buffer), (size,), generator=self._rng))


class ReplayLoader:
    """Each batch ``(x, y)`` of ``base`` joined by as many samples drawn from ``replay``, as ``(x, y, weights)``.

    The weights make the client's loss CE(batch) + λ·CE(replay) (see :func:`join_replay`). Without a
    replay buffer (a node's first round) the base batches pass through unchanged.

    Args:
        base: The batches to join (the real loader, or :class:`BufferBatches`); must have a length.
        replay: The buffer received from the predecessor, or ``None``.
        replay_weight: λ.
        seed: Seed of the replay draws; the stream continues across passes (local epochs).

    """

    def __init__(self, base: Iterable[Batch], replay: ReplayBuffer | None, replay_weight: float, seed: int) -> None:
        self.base, self.replay, self.replay_weight = base, replay, replay_weight
        self._rng = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self) -> Iterator[Batch]:
        for x, y, *_ in self.base:
            if self.replay is None:
                yield x, y
                continue
            xr, yr = self.replay.take(torch.randint(len(self.replay), (len(y),), generator=self._rng))
            yield join_replay(x, y, xr, yr, self.replay_weight)
