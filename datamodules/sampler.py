"""Seeded, resumable shuffling for per-client loaders.

A client's batches must depend only on ``(seed, client, how many times the client has been iterated)``; never on
the global RNG, on other clients or on the shared Trainer's epoch counter. :class:`SeededEpochSampler` draws its
permutations from a private generator reseeded from those three values on every pass.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

# Seeds must fit a signed 64-bit integer (numpy and torch accept them); 63 bits keeps them non-negative.
_SEED_MASK = (1 << 63) - 1


def stable_seed(*parts: int | str) -> int:
    """Derives a seed from a tuple of ints and strings, stable across processes and Python versions.

    Python's ``hash()`` is salted per process for strings, so it cannot be used for reproducible seeds.

    Args:
        *parts: The values the seed depends on, e.g. ``(seed, "style", "site3")``. Integer-like values
            (including numpy integers) are normalised to ``int`` so ``np.int64(3)`` and ``3`` give the same seed.

    Returns:
        A non-negative integer below ``2**63``.

    Raises:
        TypeError: If a part is neither a string nor integer-like.

    """
    normalised: list[int | str] = []
    for part in parts:
        if isinstance(part, str):
            normalised.append(part)
        else:
            try:
                normalised.append(operator.index(part))
            except TypeError as err:
                raise TypeError(f"stable_seed parts must be int or str, got {type(part).__name__}: {part!r}") from err
    digest = hashlib.sha256(repr(tuple(normalised)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & _SEED_MASK


class SeededEpochSampler(Sampler[int]):
    """Shuffling sampler whose order depends only on its seed and on how many passes it has made.

    Each pass (each ``iter()``) yields ``num_samples`` indices made by concatenating random permutations of
    ``range(data_len)``; permutation ``k`` of pass ``e`` comes from a generator seeded with
    ``stable_seed(seed, e, k)``. After the pass has been drawn the epoch counter increments, so the next pass
    differs but a fresh sampler with the same seed and epoch replays it exactly.

    Deliberately there is **no** ``set_epoch`` method: Lightning calls ``set_epoch(trainer.current_epoch)`` on any
    sampler that has one, and in this project one Trainer is shared by all clients, so its epoch counter reflects
    every client's training, not this client's. The sampler counts its own passes instead.

    Args:
        data_len: Number of samples in the dataset (must be >= 1).
        seed: Base seed, typically ``stable_seed(global_seed, client_id)``.
        num_samples: Indices per pass; defaults to ``data_len``. May exceed ``data_len`` (the pass then spans
            several permutations), which is how a fixed number of local steps is served.

    Raises:
        ValueError: If ``data_len`` or ``num_samples`` is not positive.

    """

    def __init__(self, data_len: int, seed: int, num_samples: int | None = None) -> None:
        if data_len < 1:
            raise ValueError(f"SeededEpochSampler needs data_len >= 1, got {data_len}")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"SeededEpochSampler needs num_samples >= 1, got {num_samples}")
        self.data_len = int(data_len)
        self.seed = int(seed)
        self.num_samples = int(num_samples) if num_samples is not None else self.data_len
        # A one-element list so views made by `with_num_samples` share the pass counter with their parent.
        self._epoch_ref: list[int] = [0]

    @property
    def epoch(self) -> int:
        """Number of passes drawn so far (shared with every view of this sampler)."""
        return self._epoch_ref[0]

    @epoch.setter
    def epoch(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"epoch must be >= 0, got {value}")
        self._epoch_ref[0] = int(value)

    def with_num_samples(self, num_samples: int | None) -> SeededEpochSampler:
        """Returns a view drawing ``num_samples`` per pass that shares this sampler's seed and epoch counter.

        Used so loaders with different step budgets for the same client advance one common pass counter without
        mutating the length of loaders created earlier.

        Args:
            num_samples: Indices per pass for the view; ``None`` means ``data_len``.

        Returns:
            A new sampler object sharing the epoch counter.

        """
        view = SeededEpochSampler(self.data_len, self.seed, num_samples)
        view._epoch_ref = self._epoch_ref
        return view

    def draw(self) -> list[int]:
        """Draws the indices of the current pass and advances the epoch counter.

        Returns:
            ``num_samples`` indices in ``[0, data_len)``.

        """
        epoch = self.epoch
        chunks: list[torch.Tensor] = []
        remaining = self.num_samples
        k = 0
        while remaining > 0:
            generator = torch.Generator().manual_seed(stable_seed(self.seed, epoch, k))
            perm = torch.randperm(self.data_len, generator=generator)
            chunks.append(perm[:remaining])
            remaining -= len(chunks[-1])
            k += 1
        self.epoch = epoch + 1
        return torch.cat(chunks).tolist()

    def __iter__(self) -> Iterator[int]:
        # Draw eagerly so the epoch advances exactly once per pass, even if the pass is abandoned early.
        return iter(self.draw())

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, int]:
        """Returns the resumable state (the pass counter).

        Returns:
            ``{"epoch": int}``.

        """
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores the pass counter saved by :meth:`state_dict`.

        Args:
            state: A dict with key ``"epoch"``.

        Raises:
            KeyError: If ``"epoch"`` is missing.

        """
        if "epoch" not in state:
            raise KeyError(f"SeededEpochSampler state needs key 'epoch', got keys {sorted(state)}")
        self.epoch = int(state["epoch"])
