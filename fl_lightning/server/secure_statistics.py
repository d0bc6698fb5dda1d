"""Secure federated statistics: the server learns the pooled sums only, never one site's summaries.

Three rounds of ``stats`` tasks over the run's transport (the site's half: :mod:`fl_lightning.runtime.secure_stats`):
``keys`` (each client's fresh public key and the vector's layout), ``sum`` (each client's masked vector), and, when
keyed clients did not send theirs, ``remask`` (the survivors' mask corrections). Summed modulo 2^64 the masks
cancel and the server decodes the pooled sums (:mod:`fl_lightning.ops.stats_vector`); it then applies the
small-cell rule to the pooled cells and derives the pooled statistics as in the clear
(:func:`fl_lightning.server.statistics.derive`).

What it protects: one site's counts, histograms and sums from the server and the transport (honest but curious).
What not: what the pooled numbers reveal (add ``stats_epsilon`` noise at the sites for that), the flags in the
clear (which splits a site released, whether it has case ids), a server that lies about who dropped out, and
colluding sites. At least two sites must take part in each sum.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fl_lightning.ops import secagg, stats_vector
from fl_lightning.ops.disclosure import release
from fl_lightning.ops.stats_vector import MISSING, STATS_BITS
from fl_lightning.server.statistics import ask, derive, derive_missing
from fl_lightning.wire.protocol import STATS_SPLITS


def _need_two(clients: list[str], failed: dict[str, str], phase: str) -> None:
    if len(clients) < 2:
        raise RuntimeError(
            f"secure statistics need two sites or more in each sum, and only {clients} answered the {phase} phase "
            f"(failed: {failed}); fix the failing sites, or run the statistics with --federation.stats_secure=false"
        )


def _int64_vector(value: Any, size: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.ndim == 1 and value.numel() == size


def collect_secure(
    transport: Any, client_ids: list[str], opts: dict[str, Any], session: str
) -> tuple[dict[str, dict[str, Any]], dict[str, Any], dict[str, str], dict[str, Any]]:
    """The pooled sums ``{section: {key: value}}``, every summed client's flags, failed clients, stricter sites.

    The last two as in :func:`fl_lightning.server.statistics.collect`.

    Raises:
        RuntimeError: If fewer than two clients remain in a phase.
    """
    failed: dict[str, str] = {}
    keyed = ask(transport, client_ids, {**opts, "phase": "keys"}, failed)
    spec = next(iter(keyed.values()), {}).get("layout")
    for cid, m in list(keyed.items()):  # every layout the first's (the same config), every key 32 bytes of hex
        if m.get("layout") != spec or not isinstance(m.get("public_key"), str) or len(m["public_key"]) != 64:
            failed[cid] = f"its statistics' layout or public key is not the others' ({m.get('layout')})"
            del keyed[cid]
    _need_two(list(keyed), failed, "keys")
    size = stats_vector.layout_size(spec)
    peers = {cid: m["public_key"] for cid, m in keyed.items()}
    sent = ask(transport, list(keyed), {**opts, "phase": "sum", "peers": peers, "session": session,
                                         "layout": spec}, failed)  # fmt: skip
    for cid, m in list(sent.items()):
        if not _int64_vector(m.get("masked"), size) or not isinstance(m.get("flags"), dict):
            failed[cid] = f"it sent no masked statistics vector of {size} entries"
            del sent[cid]
    uploads = [m["masked"] for m in sent.values()]
    if len(sent) < len(keyed):
        _need_two(list(sent), failed, "sum")
        survivors = list(sent)
        warnings.warn(f"secure statistics: {sorted(set(keyed) - set(sent))} sent no upload; the masks of the "
                      f"{len(survivors)} that did are drawn again over them", stacklevel=2)  # fmt: skip
        after = {c: peers[c] for c in survivors}
        answers = ask(transport, survivors, {**opts, "phase": "remask", "before": peers, "after": after,
                                              "session": session}, failed)  # fmt: skip
        corrections = [a.get("correction") for a in answers.values()]
        if set(answers) != set(survivors) or not all(_int64_vector(c, size) for c in corrections):
            raise RuntimeError(f"secure statistics: not every survivor of {survivors} sent its mask correction "
                               f"(failed: {failed}); the pooled sums cannot be unmasked")  # fmt: skip
        uploads += [a["correction"] for a in answers.values()]
    total = secagg.unmasked_sum(uploads, STATS_BITS)
    rules = {cid: m.get("rules", opts) for cid, m in sent.items()}
    exact = all(r.get("epsilon") is None for r in rules.values())
    pooled = stats_vector.unflatten(spec, total, counts_exact=exact)
    stricter = {cid: r for cid, r in rules.items() if r != opts}
    return pooled, {cid: m["flags"] for cid, m in sent.items()}, failed, stricter


def pooled_report(
    pooled: dict[str, dict[str, Any]], flags: dict[str, Any], failed: dict[str, str], opts: dict[str, Any],
    stricter: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """``stats.json``'s content of a secure sum: the rules, each site's flags (nothing else of it), pooled ones.

    A pooled split counts the sites that released it; its cases are known only if every such site has case ids,
    its mean and std only if every such site released its sums; its count cells under ``min_count`` are withheld.
    """
    min_count = int(opts["min_count"])
    out: dict[str, Any] = {}
    for split in STATS_SPLITS:
        shown = [f[split] for f in flags.values() if f.get(split, {}).get("released")]
        if not shown:
            continue
        summary = dict(pooled[split])
        if not all(f.get("cases") for f in shown):
            summary["cases"] = None
        if not all(f.get("sums") for f in shown):
            summary["sum"] = summary["sumsq"] = None
        summary = release(summary, min_count=min_count, sigma=None, sample_kind="pooled")
        stats = derive([summary])
        stats.update(sites=len(shown), sites_withheld=len(flags) - len(shown))
        out[split] = stats
    shown = [f[MISSING] for f in flags.values() if f.get(MISSING, {}).get("released")]
    if shown:
        summary = release({**pooled[MISSING], "names": shown[0]["names"]}, min_count=min_count, sigma=None,
                          sample_kind="pooled", size_key="rows")  # fmt: skip
        out[MISSING] = {**derive_missing([summary]), "sites": len(shown), "sites_withheld": len(flags) - len(shown)}
    sites = {c: {"released": {"secure": "in the pooled sums only", **f}, "statistics": {}} for c, f in flags.items()}
    return {"rules": opts, "secure": {"bits": STATS_BITS, "sites": sorted(flags)}, "site_rules": dict(stricter),
            "sites": sites, "pooled": out, "failed": failed}  # fmt: skip
