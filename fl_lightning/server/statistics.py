"""``federation.mode: stats``: federated statistics of every client's data, pooled on the server.

The server sends one ``stats`` task per client through the run's transport (in process, to the ranks or to the
Flower sites: the same boundary as training); each site answers with its released summaries
(:mod:`fl_lightning.runtime.site_stats`: small cells withheld, noise if asked). The server derives per site and
pooled: sample and case counts, label prevalence, the intensity histogram and per-channel mean and std (images) or
per-column mean and std and the site's quartiles (tables). Pooled numbers add the released parts only: a withheld
split or cell is left out and counted, so they equal the pooled data's exactly when nothing was withheld and no
noise was added. A client that fails (it raised, timed out or sent a malformed reply) is recorded and left out.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from fl_lightning.ops.stats_vector import MISSING
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import STATS_SPLITS, Task


def collect(
    transport: Any, client_ids: list[str], opts: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """Every client's released summaries ``{client: {split: summary}}``, the failed ones, the stricter ones.

    The failed ones ``{client: why}``; the rules of the sites that applied stricter ones than ``opts`` (their own
    floor) ``{client: rules}``.
    """
    failed: dict[str, str] = {}
    answers = ask(transport, client_ids, opts, failed)
    released = {cid: metrics["stats"] for cid, metrics in answers.items()}
    stricter = {cid: m["rules"] for cid, m in answers.items() if m.get("rules", opts) != opts}
    return released, failed, stricter


def ask(transport: Any, client_ids: list[str], options: dict[str, Any], failed: dict[str, str]) -> dict[str, Any]:
    """The reply metrics of every client that answered a ``stats`` task of ``options``; the others go to ``failed``.

    A failed client is warned about and left out; the others still answer.
    """
    tasks = [Task(protocol.STATS, 0, cid, options=options) for cid in client_ids]
    out = {}
    for cid, reply in zip(client_ids, transport.stream(tasks)):
        if reply.error is not None:
            warnings.warn(f"client {cid!r} failed and is left out of the statistics: {reply.error}", stacklevel=3)
            failed[cid] = reply.error
        else:
            out[cid] = reply.metrics
    return out


def _add(total: list[float | None] | None, part: list[float | None]) -> tuple[list[float | None], int]:
    """Element-wise sum of the released cells (None where no site released the cell); how many were withheld."""
    total = total or [None] * len(part)
    added = [t if p is None else (p if t is None else t + p) for t, p in zip(total, part)]
    return added, sum(p is None for p in part)


def derive(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One split's statistics over ``summaries`` (one site's or every site's released ones), withheld ones skipped."""
    shown = [s for s in summaries if "withheld" not in s]
    out: dict[str, Any] = {"sites": len(shown), "sites_withheld": len(summaries) - len(shown)}
    if not shown:
        return out
    out["n"] = sum(s["n"] for s in shown)
    out["cases"] = None if any(s["cases"] is None for s in shown) else sum(s["cases"] for s in shown)
    labels, cells = None, 0
    for s in shown:
        labels, k = _add(labels, s["labels"])
        cells += k
    total = sum(c for c in labels if c is not None)
    out["labels"], out["label_cells_withheld"] = labels, cells
    out["prevalence"] = [None if c is None or total <= 0 else c / total for c in labels]
    if "histogram" in shown[0]:
        hist, cells = None, 0
        for s in shown:
            hist, k = _add(hist, s["histogram"])
            cells += k
        out["histogram"], out["histogram_cells_withheld"] = hist, cells
    if all(s.get("sum") is not None for s in shown):
        count = sum(s["values"] for s in shown)
        sums = [sum(v) for v in zip(*(s["sum"] for s in shown))]
        squares = [sum(v) for v in zip(*(s["sumsq"] for s in shown))]
        out["mean"] = [t / count for t in sums]
        out["std"] = [math.sqrt(max(q / count - m * m, 0.0)) for q, m in zip(squares, out["mean"])]
    if len(shown) == 1 and shown[0].get("quantiles") is not None:
        out["quantiles"] = shown[0]["quantiles"]  # a site's own; quartiles do not add up across sites
    return out


def derive_missing(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """A table's missing cells over ``summaries`` (one site's or every site's).

    Rows read, and per used column its missing cells and their share of the rows; withheld summaries and cells
    are skipped and counted.
    """
    shown = [s for s in summaries if "withheld" not in s]
    out: dict[str, Any] = {"sites": len(shown), "sites_withheld": len(summaries) - len(shown)}
    if not shown:
        return out
    rows = sum(s["rows"] for s in shown)
    counts, cells = None, 0
    for s in shown:
        counts, k = _add(counts, s["columns"])
        cells += k
    out.update(rows=rows, columns=shown[0]["names"], missing=counts, cells_withheld=cells)
    out["share"] = [None if c is None or rows <= 0 else c / rows for c in counts]
    return out


def report(
    released: dict[str, Any], failed: dict[str, str], opts: dict[str, Any], stricter: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``stats.json``'s content: the release rules, per site its released summaries and statistics, pooled ones.

    The sites' stricter rules are under ``site_rules``.
    """

    def one(key: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return derive_missing(parts) if key == MISSING else derive(parts)

    sites = {cid: {"released": rel, "statistics": {k: one(k, [v]) for k, v in rel.items()}}
             for cid, rel in released.items()}  # fmt: skip
    pooled = {}
    for key in (*STATS_SPLITS, MISSING):
        parts = [rel[key] for rel in released.values() if key in rel]
        if parts:
            pooled[key] = one(key, parts)
    return {"rules": opts, "site_rules": dict(stricter or {}), "sites": sites, "pooled": pooled, "failed": failed}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _count(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def table_text(rep: dict[str, Any]) -> str:
    """The per-site table with a pooled row: counts per split, cases, training label prevalence and mean ± std."""
    lines = ["client   | train | val   | test  | cases | train prevalence by class | train mean ± std",
             "---------|-------|-------|-------|-------|---------------------------|-----------------"]  # fmt: skip
    rows = [(cid, site["statistics"]) for cid, site in rep["sites"].items()] + [("pooled", rep["pooled"])]
    for name, stats in rows:
        masked = bool(rep.get("secure")) and name != "pooled"  # a secure sum's sites show nothing of their own
        counts = []
        for split in STATS_SPLITS:
            s = stats.get(split)
            counts.append("masked" if masked else "—" if s is None else "withheld" if "n" not in s else _count(s["n"]))
        train = stats.get("train", {})
        prevalence = " ".join(_fmt(p, 2) for p in train.get("prevalence", [])) or ("masked" if masked else "withheld")
        mean = train.get("mean")
        spread = "—" if mean is None else f"{_fmt(sum(mean) / len(mean))} ± {_fmt(sum(train['std']) / len(mean))}"
        lines.append(f"{name:8s} | {counts[0]:5s} | {counts[1]:5s} | {counts[2]:5s} | {_count(train.get('cases')):5s} "
                     f"| {prevalence:25s} | {spread}")  # fmt: skip
    for name, stats in rows:
        missing = stats.get(MISSING)
        if missing and "rows" in missing:
            cells = ", ".join(f"{c} {_count(k)}" for c, k in zip(missing["columns"], missing["missing"]) if k != 0)
            lines.append(f"{name:8s} | {_count(missing['rows'])} rows read; missing cells: {cells or 'none'}")
    for cid, why in rep["failed"].items():
        lines.append(f"{cid:8s} | failed: {why}")
    rules = rep["rules"]
    noise = "no noise" if rules["epsilon"] is None else f"Gaussian noise, ε={rules['epsilon']}, δ={rules['delta']}"
    lines.append(f"(min_count={rules['min_count']}: smaller splits and cells withheld; {noise})")
    if rep.get("secure"):
        lines.append(f"(secure sum over {', '.join(rep['secure']['sites'])}: the server saw the pooled sums only; "
                     "small cells withheld from the pooled cells)")  # fmt: skip
    for cid, own in rep.get("site_rules", {}).items():
        lines.append(f"({cid} applied its own stricter rules: min_count={own['min_count']}, ε={own['epsilon']})")
    return "\n".join(lines)


def plot(rep: dict[str, Any], path: Path) -> None:
    """``stats.png``: each site's training label prevalence (stacked bars) and intensity histogram (images)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites = {cid: s["statistics"].get("train", {}) for cid, s in rep["sites"].items()}
    with_hist = any("histogram" in s for s in sites.values())
    fig, axes = plt.subplots(1, 2 if with_hist else 1, figsize=(11 if with_hist else 6, 3.5), squeeze=False)
    ax = axes[0][0]
    names = list(sites)
    bottoms = [0.0] * len(names)
    classes = max((len(s.get("prevalence", [])) for s in sites.values()), default=0)
    for k in range(classes):
        heights = [(sites[c].get("prevalence") or [None] * classes)[k] or 0.0 for c in names]
        ax.bar(names, heights, bottom=bottoms, label=str(k))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_title("training label prevalence (withheld cells blank)")
    ax.tick_params(axis="x", rotation=45)
    if 0 < classes <= 12:
        ax.legend(fontsize=6, ncol=2, title="class")
    if with_hist:
        ax = axes[0][1]
        for cid, s in sites.items():
            hist = s.get("histogram")
            if hist:
                total = sum(h for h in hist if h is not None) or 1.0
                shares = [float("nan") if h is None else h / total for h in hist]
                ax.plot([(i + 0.5) / len(hist) for i in range(len(hist))], shares, label=cid)
        ax.set_title("training intensity histogram")
        ax.set_xlabel("intensity")
        if ax.get_legend_handles_labels()[0]:  # every site may have withheld its histogram
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
