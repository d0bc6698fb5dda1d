"""Secure aggregation of model updates with key-agreed pairwise masks (Bonawitz et al., CCS 2017, without recovery).

Every client holds an X25519 key pair drawn from the operating system's randomness (never from the run seed).
For each pair of clients (a, b) of a round, both derive the same 32-byte key from their X25519 shared secret with
HKDF-SHA256, ``info`` binding the session, round, group and pair; the key seeds an AES-256-CTR keystream, read as
uint64 words r_ab. The client first in id order adds r_ab, the other subtracts it. Updates are fixed-point
quantised to integers and everything is summed modulo 2^64 (uint64 wraparound), so the masks cancel exactly
in the sum of all the pair's uploads while each upload alone is uniformly distributed.

Quantisation: q(x) = round(x · 2^bits), so |q(x)/2^bits − x| ≤ 2^-(bits+1) per entry, and a sum over m clients is
off by at most m · 2^-(bits+1). The true integer sum must fit in int64 for the decoding to be right:
:func:`quantize` refuses any entry with |q(x)| ≥ 2^63 / m.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import Tensor

# `cryptography` is imported where it is used: every process importing ``callbacks`` would pay for it otherwise.

# Payload entries of Flower's SecAgg+ (fl_lightning.engines.flower_secagg): a fit task's settings, a reply's p_i Δ_i.
SECAGGPLUS_SETTINGS, SECAGGPLUS_UPDATE = "secaggplus", "secaggplus_update"
DEFAULT_BITS = 32  # 2^-33 ≈ 1.2e-10 per entry and client: far below float32's resolution of a weight


def generate_private_key() -> bytes:
    """A fresh X25519 private key (raw 32 bytes) from the OS's randomness (``os.urandom``), not any seed."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    return X25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_key(private: bytes) -> bytes:
    """The raw 32-byte X25519 public key of a raw private key."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def pair_info(session: str, round_idx: int, group: str, a: str, b: str) -> bytes:
    """HKDF ``info`` of a pair's mask key: unambiguous (JSON), order-independent, fresh per session and round."""
    lo, hi = sorted((a, b))
    return json.dumps(["fl_lightning/secagg/v1", session, round_idx, group, lo, hi]).encode()


def pair_key(private: bytes, peer_public: bytes, info: bytes) -> bytes:
    """The 32-byte mask key two clients share: HKDF-SHA256 of their X25519 shared secret."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def prg(key: bytes, size: int) -> np.ndarray:
    """``size`` pseudo-random uint64 words: the AES-256-CTR keystream of ``key`` (a key is used for one mask only)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(8 * size)) + encryptor.finalize()
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64)  # little-endian on every host


def client_mask(
    client: str, private: bytes, peers: Mapping[str, bytes], size: int, session: str, round_idx: int, group: str
) -> np.ndarray:
    """Σ_b ±r_{client,b} over the round's other clients (uint64, modulo 2^64); + when ``client`` sorts first.

    Args:
        client: This client's id.
        private: Its raw X25519 private key.
        peers: Every participating client's raw public key (this client's own entry is skipped).
        size: Vector length.
        session: Identifier of the run (binds the keys to it).
        round_idx: The round (fresh masks every round).
        group: The model group.

    """
    out = np.zeros(size, dtype=np.uint64)
    for other, public in peers.items():
        if other == client:
            continue
        r = prg(pair_key(private, public, pair_info(session, round_idx, group, client, other)), size)
        if client < other:
            np.add(out, r, out=out)  # uint64 arithmetic wraps modulo 2^64 by definition
        else:
            np.subtract(out, r, out=out)
    return out


def retry_session(session: str, dropped: Iterable[str]) -> str:
    """The session a round's masks are drawn for again without the ``dropped`` clients (fresh pair keys)."""
    return f"{session}|without:{','.join(sorted(dropped))}"


def mask_correction(
    client: str,
    private: bytes,
    before: Mapping[str, bytes],
    after: Mapping[str, bytes],
    size: int,
    sessions: tuple[str, str],
    round_idx: int,
    group: str,
) -> np.ndarray:
    """What turns this client's masked upload over the peers ``before`` into one over ``after`` (uint64).

    new mask − old mask modulo 2^64, the old one of session ``sessions[0]``, the new of ``sessions[1]``: added to the
    upload the server holds, it gives q(p_i Δ_i) + new mask, whose masks cancel over ``after`` alone. Nothing of the
    update is in it, so the client need not keep its update to answer.
    """
    new = client_mask(client, private, after, size, sessions[1], round_idx, group)
    return np.subtract(new, client_mask(client, private, before, size, sessions[0], round_idx, group))


def quantize(values: Tensor, bits: int, num_clients: int) -> np.ndarray:
    """Fixed-point round(x · 2^bits) as two's-complement uint64 words.

    Raises:
        OverflowError: If an entry is so large that the sum over ``num_clients`` could leave int64.

    """
    scaled = torch.round(values.detach().double().cpu() * 2.0**bits)
    limit = 2.0**63 / max(num_clients, 1)
    if scaled.numel() and scaled.abs().max().item() >= limit:
        raise OverflowError(
            f"an update entry of {values.abs().max().item():.3g} overflows the fixed point with {bits} fraction bits "
            f"over {num_clients} clients: lower `bits`"
        )
    return scaled.to(torch.int64).numpy().view(np.uint64)


def dequantize(total: np.ndarray, bits: int) -> Tensor:
    """The float64 value of a uint64 fixed-point sum (read as two's complement)."""
    return torch.from_numpy(total.view(np.int64).astype(np.float64) / 2.0**bits)


def masked_upload(values: Tensor, mask: np.ndarray, bits: int, num_clients: int) -> Tensor:
    """Client side: quantise(values) + mask modulo 2^64, as an int64 tensor (what leaves the client)."""
    out = np.add(quantize(values, bits, num_clients), mask)
    return torch.from_numpy(out.view(np.int64).copy())


def unmasked_sum(uploads: Iterable[Tensor], bits: int) -> Tensor:
    """Server side: the sum of all uploads modulo 2^64, decoded; equals Σ values when every client's is in it.

    Raises:
        ValueError: On no uploads or uploads of different lengths.

    """
    total: np.ndarray | None = None
    for upload in uploads:
        words = upload.detach().cpu().numpy().astype(np.int64, copy=False).view(np.uint64)
        if total is None:
            total = words.copy()
        elif words.shape != total.shape:
            raise ValueError(f"masked uploads of lengths {total.shape[0]} and {words.shape[0]}")
        else:
            np.add(total, words, out=total)
    if total is None:
        raise ValueError("secure aggregation over zero uploads")
    return dequantize(total, bits)
