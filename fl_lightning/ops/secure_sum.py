"""Secure aggregation by pairwise additive masking: the server learns only the sum over clients.

Every pair of clients (i, j), i before j, derives a shared pseudo-random mask r_ij from a pair
seed; client i adds r_ij, client j subtracts it. Each masked vector looks random on its own, and
the masks cancel exactly in the sum. Values are fixed-point encoded as int64 so the cancellation
is exact (float masks would leave rounding residue).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

FRACTION_BITS = 24  # fixed-point resolution 2^-24 ≈ 6e-8
MASK_RANGE = 2**40  # masks in [-2^40, 2^40): far above any encoded value, far below int64 overflow


def pair_seed(seed: int, a: str, b: str) -> int:
    """The seed two clients share (in a deployment: from a key agreement); order-independent."""
    lo, hi = sorted((a, b))
    digest = hashlib.sha256(f"{seed}|{lo}|{hi}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def pairwise_masks(client_ids: Sequence[str], size: int, seed: int) -> dict[str, Tensor]:
    """Each client's mask (int64, length ``size``); the masks of all clients sum to zero exactly.

    Args:
        client_ids: All participating clients, in a fixed order (the first of a pair adds, the second subtracts).
        size: Vector length.
        seed: Session seed.

    """
    masks = {c: torch.zeros(size, dtype=torch.int64) for c in client_ids}
    for i, a in enumerate(client_ids):
        for b in client_ids[i + 1 :]:
            g = torch.Generator().manual_seed(pair_seed(seed, a, b))
            r = torch.randint(-MASK_RANGE, MASK_RANGE, (size,), generator=g, dtype=torch.int64)
            masks[a] += r
            masks[b] -= r
    return masks


def encode(values: Tensor, bits: int = FRACTION_BITS) -> Tensor:
    """Fixed-point int64 encoding of a float vector."""
    return torch.round(values.double() * 2**bits).to(torch.int64)


def decode(encoded: Tensor, bits: int = FRACTION_BITS) -> Tensor:
    """Inverse of :func:`encode` (float64)."""
    return encoded.double() / 2**bits


def mask(values: Tensor, client_mask: Tensor, bits: int = FRACTION_BITS) -> Tensor:
    """Client side: the encoded vector plus the client's mask (what leaves the client)."""
    return encode(values, bits) + client_mask


def server_sum(masked_vectors: Iterable[Tensor], bits: int = FRACTION_BITS) -> Tensor:
    """Server side: sees only masked vectors and returns their decoded sum (the masks cancel)."""
    total = None
    for v in masked_vectors:
        total = v.clone() if total is None else total + v
    if total is None:
        raise ValueError("secure sum over zero clients")
    return decode(total, bits)


def client_mask(client_ids: Sequence[str], client: str, size: int, seed: int) -> Tensor:
    """One client's mask of :func:`pairwise_masks`, computed from its own pair seeds only (O(N), not O(N²)).

    Args:
        client_ids: All participating clients, in the same fixed order as every other client uses.
        client: The client whose mask this is.
        size: Vector length.
        seed: Session seed.

    """
    ids = list(client_ids)
    at = ids.index(client)
    out = torch.zeros(size, dtype=torch.int64)
    for j, other in enumerate(ids):
        if j == at:
            continue
        g = torch.Generator().manual_seed(pair_seed(seed, client, other))
        r = torch.randint(-MASK_RANGE, MASK_RANGE, (size,), generator=g, dtype=torch.int64)
        out += r if at < j else -r  # the first of a pair adds, the second subtracts
    return out
