"""Secure aggregation's cost per round for 10, 100 and 1,000 clients, against FedAvg's plain weighted sum.

The updates have the size of the digits SmallCNN (width 32, GroupNorm, 16 px, 10 classes: every floating entry of
its state dict, as ``callbacks.SecureAggregation`` masks them) and are synthetic (N(0, 0.01²) per entry, float32,
weights 1/m): the cost of masking and summing does not depend on the values. Everything is measured on the
library's own functions (``fl_lightning.ops.secagg``), without the federation around them:

- ``client``: one client's whole masking, with m − 1 peers: quantisation, then per peer an X25519 agreement,
  HKDF-SHA256 and an AES-256-CTR keystream of the model's size added or subtracted modulo 2^64
  (``secagg.client_mask`` + ``secagg.masked_upload``); ``keys`` is the agreement + HKDF part of it. The pairwise
  masks make this O(m) per client; the clients mask in parallel, so it is the round's added latency, and m times it
  the round's total client CPU (O(m²)), which is extrapolated from the one client, not measured.
- ``server``: the unmasking sum over the m uploads modulo 2^64, decoded and added to the global weights as
  ``SecureAggregation.on_mean`` does (O(m)), against FedAvg's ``weighted_average`` of the m client states in the
  same run (the ratio).
- bytes: the encoded size (``protocol.encoded_size``) of one client's reply, masked (int64 words, no state) and
  plain (its float32 state), and of the extra payload in each task (the round's m public keys: O(m) per client).

Masked uploads of every client need every pair's mask, O(m²) keystreams in all: the masked sum is built (and
checked against the plain sum within the quantisation bound m · 2^-(bits+1)) only for m ≤ ``--verify-up-to``;
above that the server's sum is timed on uniformly random words, which costs the same (the sum never looks at the
values) but checks nothing.

    python benchmarks/secagg.py [--clients 10 100 1000] [--repeats 3] [--verify-up-to 100] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from callbacks.secure_aggregation import masked_names
from fl_lightning.models.registry import build_classifier
from fl_lightning.ops import secagg, weighted_average
from fl_lightning.wire import protocol

SESSION, GROUP, ROUND = "bench", "global", 0


def model_state(width: int = 32, size: int = 16) -> dict[str, torch.Tensor]:
    """The global state: the digits SmallCNN's state dict (its floating entries are what an update masks)."""
    torch.manual_seed(0)
    net = build_classifier("cnn", 1, 10, (size, size), width=width, norm="group")
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def client_states(glob: dict[str, torch.Tensor], m: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """m client states w_i = w + Δ_i, Δ_i ~ N(0, 0.01²) on every floating entry."""
    g = torch.Generator().manual_seed(seed)
    return [
        {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in glob.items()}
        for _ in range(m)
    ]


StateDict = dict[str, torch.Tensor]


def flat(state: StateDict, glob: StateDict, names: list[str], weight: float) -> torch.Tensor:
    """p_i · (w_i − w) flattened in ``names`` order (float64), as the callback's client half forms it."""
    return torch.cat([(state[k].double() - glob[k].double()).reshape(-1) for k in names]) * weight


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls (after one warm-up call) and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def ids(m: int) -> list[str]:
    """Client ids of the federation's form, sorting as their numbers do."""
    return [f"site{i:04d}" for i in range(m)]


def unmask_into(glob: dict[str, torch.Tensor], names: list[str], uploads: list[torch.Tensor], bits: int) -> dict:
    """The server half: Σ uploads mod 2^64, decoded, added to the global weights entry by entry."""
    total = secagg.unmasked_sum(uploads, bits)
    out, at = dict(glob), 0
    for k in names:
        w = glob[k]
        out[k] = (w.double() + total[at : at + w.numel()].reshape(w.shape)).to(w.dtype)
        at += w.numel()
    return out


def bench(m: int, glob: dict[str, torch.Tensor], bits: int, repeats: int, verify_up_to: int) -> dict[str, float]:
    """One row: client and server seconds, bytes, and (when verified) the masked sum's largest error."""
    names = masked_names(glob, set())
    size = sum(glob[k].numel() for k in names)
    clients = ids(m)
    private = {c: secagg.generate_private_key() for c in clients}
    public = {c: secagg.public_key(k) for c, k in private.items()}
    states = client_states(glob, m)
    weights = [1.0 / m] * m
    updates = [flat(s, glob, names, w) for s, w in zip(states, weights)]

    # one client's side, with m − 1 peers (the middle one in id order: it adds half its masks, subtracts half)
    me = clients[m // 2]

    def mask_one() -> torch.Tensor:
        mask = secagg.client_mask(me, private[me], public, size, SESSION, ROUND, GROUP)
        return secagg.masked_upload(updates[m // 2], mask, bits, m)

    def keys_one() -> None:
        for other in clients:
            if other != me:
                secagg.pair_key(private[me], public[other], secagg.pair_info(SESSION, ROUND, GROUP, me, other))

    t_client, upload = timed(mask_one, repeats)
    t_keys, _ = timed(keys_one, repeats)

    error = float("nan")
    if m <= verify_up_to:  # every client's real upload: O(m²) keystreams
        uploads = [
            secagg.masked_upload(u, secagg.client_mask(c, private[c], public, size, SESSION, ROUND, GROUP), bits, m)
            for c, u in zip(clients, updates)
        ]
    else:  # uniformly random words: the same cost for the sum, nothing to check
        rng = np.random.default_rng(0)
        uploads = [torch.from_numpy(rng.integers(-(2**63), 2**63 - 1, size, dtype=np.int64)) for _ in clients]
    t_server, _ = timed(lambda: unmask_into(glob, names, uploads, bits), repeats)
    t_plain, _ = timed(lambda: weighted_average(states, weights), repeats)
    if m <= verify_up_to:  # the decoded sum against the exact Σ p_i Δ_i (float64), before any float32 rounding
        error = float((secagg.unmasked_sum(uploads, bits) - torch.stack(updates).sum(0)).abs().max())

    hexkeys = {c: k.hex() for c, k in public.items()}
    extra_down = protocol.encoded_size({"weight": 1.0 / m, "peers": hexkeys, "session": SESSION, "bits": bits})
    masked_reply = protocol.Reply(me, GROUP, state={}, payloads={"SecureAggregation": {"masked": upload}})
    plain_reply = protocol.Reply(me, GROUP, state=states[m // 2])
    return {
        "m": m,
        "entries": size,
        "client_s": t_client,
        "keys_s": t_keys,
        "server_s": t_server,
        "plain_s": t_plain,
        "up_masked": protocol.encoded_size(masked_reply),
        "up_plain": protocol.encoded_size(plain_reply),
        "down_extra": extra_down,
        "error": error,
        "bound": m * 2.0 ** -(bits + 1),  # per entry: each client's rounding to the fixed point
    }


def print_rows(rows: list[dict[str, float]], bits: int, threads: int, repeats: int, width: int, size: int) -> None:
    """A markdown table, one row per client count."""
    print(
        f"SmallCNN width {width}, GroupNorm, {size} px: {rows[0]['entries']:,} masked entries, bits={bits}, "
        f"{threads} threads, median of {repeats} runs; client = one client with m-1 peers"
    )
    head = (
        "| clients m | client mask (ms) | of which keys (ms) | all clients' CPU (s, m x client) | server unmask (ms) "
        "| FedAvg sum (ms) | server ratio | up/client masked (KB) | up/client FedAvg (KB) | up total masked (MB) "
        "| extra down/client (KB) | max error (verified) |"
    )
    print(head)
    print("|" + "---|" * head.count(" |"))
    for r in rows:
        err = "not built" if r["error"] != r["error"] else f"{r['error']:.1e} (bound {r['bound']:.1e})"
        print(
            f"| {r['m']:,} | {r['client_s'] * 1e3:.1f} | {r['keys_s'] * 1e3:.1f} | {r['m'] * r['client_s']:.2f} "
            f"| {r['server_s'] * 1e3:.1f} | {r['plain_s'] * 1e3:.1f} | {r['server_s'] / r['plain_s']:.2f}x "
            f"| {r['up_masked'] / 1e3:.1f} | {r['up_plain'] / 1e3:.1f} | {r['m'] * r['up_masked'] / 1e6:.1f} "
            f"| {r['down_extra'] / 1e3:.1f} | {err} |"
        )


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--verify-up-to", type=int, default=100)
    parser.add_argument("--bits", type=int, default=secagg.DEFAULT_BITS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--size", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    glob = model_state(args.width, args.size)
    rows = [bench(m, glob, args.bits, args.repeats, args.verify_up_to) for m in args.clients]
    print_rows(rows, args.bits, args.threads, args.repeats, args.width, args.size)
    return rows


if __name__ == "__main__":
    main()
