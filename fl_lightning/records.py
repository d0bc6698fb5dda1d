"""Turn a round's results into rows, logged metrics, the final summary and the terminal line (pure functions)."""

from __future__ import annotations

from typing import Any

MODELS = ("global", "personal")


def client_rows(
    round_idx: int,
    client_ids: list[str],
    selected: set[str],
    failed: set[str],
    trained: dict[str, dict[str, Any]],
    evaluation: dict[str, Any],
) -> list[dict[str, Any]]:
    """One ``metrics.csv`` row per client for round ``round_idx`` (1-based), evaluated or not."""
    rows = []
    for cid in client_ids:
        row: dict[str, Any] = {"round": round_idx, "client": cid, "selected": int(cid in selected)}
        row["failed"] = int(cid in failed)
        row.update(trained.get(cid, {}))
        for model, per_client in evaluation.get("clients", {}).items():
            row.update({f"{model}/{k}": v for k, v in per_client.get(cid, {}).items()})
        rows.append(row)
    return rows


def logged_metrics(
    round_row: dict[str, Any], trained: dict[str, dict[str, Any]], evaluation: dict[str, Any]
) -> dict[str, float]:
    """Round-level metrics for the loggers, with slash-prefixed keys.

    ``time/*``, ``throughput/*``, ``round/*`` and ``eval/<model>/<metric>`` (mean over clients, plus
    ``_std`` and ``_worst``), ``eval/pooled/<metric>``, ``client/<id>/train/<metric>`` and
    ``client/<id>/eval/<model>/<metric>``.
    """
    out = {k: float(v) for k, v in round_row.items() if "/" in k}
    for model, stats in evaluation.get("summary", {}).items():
        for metric, s in stats.items():
            out[f"eval/{model}/{metric}"] = s["mean"]
            out[f"eval/{model}/{metric}_std"] = s["std"]
            out[f"eval/{model}/{metric}_worst"] = s["worst"]
    for metric, value in evaluation.get("pooled", {}).items():
        out[f"eval/pooled/{metric}"] = value
    for cid, metrics in trained.items():
        out.update({f"client/{cid}/train/{k.removeprefix('train_')}": float(v) for k, v in metrics.items()})
    for model, per_client in evaluation.get("clients", {}).items():
        for cid, metrics in per_client.items():
            out.update({f"client/{cid}/eval/{model}/{k}": v for k, v in metrics.items()})
    return out


def summary_table(
    evaluation: dict[str, Any], test_samples: dict[str, int], pooled_samples: int | None, meta: dict[str, Any]
) -> dict[str, Any]:
    """The final evaluation table written to ``summary.json``.

    Args:
        evaluation: The last evaluation (``clients``, ``summary`` and optionally ``pooled``).
        test_samples: Test-set size of each client.
        pooled_samples: Size of the pooled test set (None when there is no pooled evaluation).
        meta: Run facts to include (run directory, mode, rounds, methods, …).

    """
    clients = {
        cid: {
            "test_samples": n,
            # global and personal first, then models that callbacks add (e.g. routed cluster models)
            **{m: evaluation["clients"][m][cid] for m in _model_order(evaluation) if cid in evaluation["clients"][m]},
        }
        for cid, n in test_samples.items()
    }
    out = {**meta, "clients": clients, "summary": evaluation["summary"]}
    if "pooled" in evaluation:
        out["pooled"] = evaluation["pooled"]
        out["pooled_test_samples"] = pooled_samples
    return out


def round_line(
    round_idx: int,
    rounds: int,
    trained: dict[str, dict[str, Any]],
    evaluation: dict[str, Any],
    seconds: float,
    metric: str = "acc",
) -> str:
    """The one-line report printed after each round (mean ± std and worst client of ``metric``)."""
    losses = [m["train_loss"] for m in trained.values()]
    parts = [f"round {round_idx}/{rounds}", f"train loss {sum(losses) / max(len(losses), 1):.4f}"]
    for model, stats in evaluation.get("summary", {}).items():
        if metric in stats:
            m = stats[metric]
            parts.append(f"{model} {metric} {m['mean']:.4f} ± {m['std']:.4f} (worst {m['worst']:.4f})")
    parts.append(f"{seconds:.1f}s")
    return " │ ".join(parts)


def _model_order(evaluation: dict[str, Any]) -> list[str]:
    """The evaluated models: ``global`` and ``personal`` first, then the others in insertion order."""
    names = list(evaluation.get("clients", {}))
    return [m for m in MODELS if m in names] + [m for m in names if m not in MODELS]
