"""Turn a round's results into rows, logged metrics, the final summary and the terminal line (pure functions)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fl_lightning.outputs.collapse import detect_collapse
from fl_lightning.wire.protocol import ROUNDS_OLD

if TYPE_CHECKING:
    from fl_lightning.wire.protocol import Reply

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
        column = "val/" if is_validation(evaluation) else ""
        for model, per_client in evaluation.get("clients", {}).items():
            row.update({f"{column}{model}/{k}": v for k, v in per_client.get(cid, {}).items()})
        if cid in evaluation.get(ROUNDS_OLD, {}):
            row[f"{column}{ROUNDS_OLD}"] = evaluation[ROUNDS_OLD][cid]
        rows.append(row)
    return rows


# Up to this many clients in a run, the loggers get per-client keys (``client/<id>/...``); beyond, one table and a
# histogram per metric per round (W&B) instead of thousands of keys (metrics.csv holds every client's rows anyway).
PER_CLIENT_KEYS_MAX = 50


def per_client_keys(num_clients: int) -> bool:
    """Whether a run of ``num_clients`` clients logs per-client keys (else tables, see :func:`client_table`)."""
    return num_clients <= PER_CLIENT_KEYS_MAX


def logged_metrics(
    round_row: dict[str, Any],
    trained: dict[str, dict[str, Any]],
    evaluation: dict[str, Any],
    per_client: bool = True,
) -> dict[str, float]:
    """Round-level metrics for the loggers, with slash-prefixed keys.

    ``time/*``, ``throughput/*``, ``round/*`` and ``eval/<model>/<metric>`` (mean over clients, plus
    ``_std`` and ``_worst``), ``eval/pooled/<metric>``, and with ``per_client`` ``client/<id>/train/<metric>`` and
    ``client/<id>/eval/<model>/<metric>``. A validation evaluation's keys start with ``val/`` instead of ``eval/``.
    """
    out = {k: float(v) for k, v in round_row.items() if "/" in k}
    prefix = split_prefix(evaluation)
    for model, stats in evaluation.get("summary", {}).items():
        for metric, s in stats.items():
            out[f"{prefix}/{model}/{metric}"] = s["mean"]
            out[f"{prefix}/{model}/{metric}_std"] = s["std"]
            out[f"{prefix}/{model}/{metric}_worst"] = s["worst"]
    for metric, value in evaluation.get("pooled", {}).items():
        out[f"{prefix}/pooled/{metric}"] = value
    if not per_client:
        return out
    for cid, metrics in trained.items():
        out.update({f"client/{cid}/train/{k.removeprefix('train_')}": float(v) for k, v in metrics.items()})
    for model, per_client in evaluation.get("clients", {}).items():
        for cid, metrics in per_client.items():
            out.update({f"client/{cid}/{prefix}/{model}/{k}": v for k, v in metrics.items()})
    return out


def client_table(trained: dict[str, dict[str, Any]], evaluation: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """One round's per-client metrics as a table: columns and one row per client that trained or was evaluated.

    Columns: ``client``, ``train/<metric>`` (the keys of :func:`logged_metrics`' ``client/<id>/train/...`` without
    the prefix) and ``eval/<model>/<metric>``; a client without a value has None there. Clients appear in the order
    they trained, then the evaluated ones in the evaluation's order.
    """
    values: dict[str, dict[str, Any]] = {}
    for cid, metrics in trained.items():
        values.setdefault(cid, {}).update({f"train/{k.removeprefix('train_')}": v for k, v in metrics.items()})
    prefix = split_prefix(evaluation)
    for model, per_client in evaluation.get("clients", {}).items():
        for cid, metrics in per_client.items():
            values.setdefault(cid, {}).update({f"{prefix}/{model}/{k}": v for k, v in metrics.items()})
    columns: dict[str, None] = {}
    for row in values.values():
        columns.update(dict.fromkeys(row))
    header = ["client", *columns]
    return header, [[cid, *(row.get(c) for c in columns)] for cid, row in values.items()]


def summary_table(
    evaluation: dict[str, Any],
    test_samples: dict[str, int],
    pooled_samples: int | None,
    meta: dict[str, Any],
    client_rows: list[dict[str, Any]] | None = None,
    num_classes: int | None = None,
) -> dict[str, Any]:
    """The final evaluation table written to ``summary.json``.

    Besides the metrics it names the clients without test images (``clients_without_test``) and holds the
    ``collapse`` checks of :func:`fl_lightning.outputs.collapse.detect_collapse` (single-class predictions, balanced
    accuracy at chance, training-loss growth), so a degenerate run is recognisable from its summary alone.

    Args:
        evaluation: The last evaluation (``clients``, ``summary`` and optionally ``pooled``).
        test_samples: Test-set size of each client.
        pooled_samples: Size of the pooled test set (None when there is no pooled evaluation).
        meta: Run facts to include (run directory, mode, rounds, methods, …).
        client_rows: All rows of ``metrics.csv`` so far (for the training-loss check; None skips it).
        num_classes: Number of classes (chance level of balanced accuracy; None skips that check).

    """
    ages = evaluation.get(ROUNDS_OLD, {})
    clients = {
        cid: {
            "test_samples": n,
            # global and personal first, then models that callbacks add (e.g. routed cluster models)
            **{m: evaluation["clients"][m][cid] for m in _model_order(evaluation) if cid in evaluation["clients"][m]},
            **({ROUNDS_OLD: ages[cid]} if cid in ages else {}),
        }
        for cid, n in test_samples.items()
    }
    out = {**meta, "clients": clients, "summary": evaluation["summary"]}
    if "pooled" in evaluation:
        out["pooled"] = evaluation["pooled"]
        out["pooled_test_samples"] = pooled_samples
    out["clients_without_test"] = [cid for cid, n in test_samples.items() if n == 0]
    out["collapse"] = detect_collapse(evaluation, client_rows, num_classes).as_dict()
    return out


# Shown next to the primary metric when the evaluation has them (classification): accuracy alone hides a model
# that predicts the majority class (0.85 on a 15 % / 85 % task), balanced accuracy and AUROC do not.
CLASS_BALANCE_METRICS = (("balanced_acc", "bacc"), ("auroc", "auroc"))


def round_line(
    round_idx: int,
    rounds: int,
    trained: dict[str, dict[str, Any]],
    evaluation: dict[str, Any],
    seconds: float,
    metric: str = "acc",
    epsilon: float | None = None,
) -> str:
    """The one plain line printed after each round; a single-model classification line fits 80 columns.

    ``round 3/10  loss 0.412  acc 0.812 worst 0.701  bacc 0.790  auroc 0.912  1.2s``: the mean training loss;
    per evaluated model the client mean and worst client of ``metric`` (the personal model only where it
    differs from the global one, prefixed by its name when more than one model is shown); for classification
    the balanced accuracy and AUROC of the pooled test set (or the first shown model's client mean where there
    is no pooled evaluation); ``ε`` spent so far under differential privacy (``epsilon``: the worst client's
    under DP-SGD); the round's seconds. Standard deviations are in ``rounds.csv`` and the final table: with them
    the line would not fit 80 columns, the width a log file is read at.
    """
    losses = [m["train_loss"] for m in trained.values()]
    parts = [f"round {round_idx}/{rounds}", f"loss {_compact(sum(losses) / max(len(losses), 1))}"]
    summary = evaluation.get("summary", {})
    shown = [m for m in _ordered(summary) if metric in summary[m]]
    if "global" in shown and "personal" in shown and summary["personal"] == summary["global"]:
        shown.remove("personal")  # nothing private (FedAvg): the personal model is the global one
    for model in shown:
        stats = summary[model][metric]
        label = f"{model} {metric}" if len(shown) > 1 else metric
        parts.append(f"{label} {stats['mean']:.3f} worst {stats['worst']:.3f}")
    source = evaluation.get("pooled")
    if not source and shown:
        source = {k: v["mean"] for k, v in summary[shown[0]].items()}
    parts += [f"{short} {source[key]:.3f}" for key, short in CLASS_BALANCE_METRICS if key in (source or {})]
    if epsilon is not None:
        parts.append(f"ε {_compact(epsilon)}")
    seconds_text = f"{seconds:.1f}"
    parts.append(f"{seconds_text if len(seconds_text) <= 4 else f'{seconds:.0f}'}s")  # "12.3s", "123s"
    return "  ".join(parts)


def round_legend(evaluation: dict[str, Any], metric: str = "acc") -> str | None:
    """What the numbers of :func:`round_line` are (``legend: …``), printed once above the first round line, or None.

    The line mixes statistics over clients with metrics of the pooled test set; this says which is which.
    """
    summary = evaluation.get("summary", {})
    if not any(metric in stats for stats in summary.values()):
        return None
    where = " (validation sets; test is read once, at the end)" if is_validation(evaluation) else ""
    parts = [f"loss: mean training loss; {metric}, worst: mean and worst client{where}"]
    balance = [short for key, short in CLASS_BALANCE_METRICS if key in (evaluation.get("pooled") or {})]
    if balance:
        parts.append(f"{', '.join(balance)}: pooled {'validation' if is_validation(evaluation) else 'test'} set")
    elif any(key in stats for stats in summary.values() for key, _ in CLASS_BALANCE_METRICS):
        parts.append(f"{', '.join(s for _, s in CLASS_BALANCE_METRICS)}: mean over clients")
    return "legend: " + "; ".join(parts)


def round_epsilon(round_row: dict[str, Any]) -> float | None:
    """The ε a privacy callback recorded in the round's row (DP-FedAvg's, or DP-SGD's worst client), or None."""
    value = round_row.get("privacy/epsilon", round_row.get("privacy/epsilon_worst"))
    return None if value is None else float(value)


def _compact(value: float) -> str:
    """Three significant digits, exponents without padding: ``0.412``, ``122``, ``2.4e7`` (a diverged loss)."""
    return f"{value:.3g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def _model_order(evaluation: dict[str, Any]) -> list[str]:
    """The evaluated models: ``global`` and ``personal`` first, then the others in insertion order."""
    return _ordered(evaluation.get("clients", {}))


def _ordered(names: Iterable[str]) -> list[str]:
    """``global`` and ``personal`` first, then the other names in their order."""
    names = list(names)
    return [m for m in MODELS if m in names] + [m for m in names if m not in MODELS]


def evaluation_means(evaluation: dict[str, Any]) -> dict[str, float]:
    """The round row's evaluation entries: ``eval/<model>/<metric>`` (client mean) and ``eval/pooled/<metric>``.

    A validation evaluation's entries are ``val/<model>/<metric>`` and ``val/pooled/<metric>``.
    """
    prefix = split_prefix(evaluation)
    out = {
        f"{prefix}/{model}/{m}": s["mean"]
        for model, stats in evaluation.get("summary", {}).items()
        for m, s in stats.items()
    }
    out.update({f"{prefix}/pooled/{m}": v for m, v in evaluation.get("pooled", {}).items()})
    return out


def final_test_metrics(chosen: dict[str, Any], chosen_round: int, last: dict[str, Any] | None) -> dict[str, float]:
    """The loggers' end-of-run test metrics of the chosen round, and of the last round (``test_last/…``) if other.

    ``test/<model>/<metric>`` (client mean, ``_std``, ``_worst``), ``test/pooled/<metric>`` and ``test/round``.
    """
    out: dict[str, float] = {"test/round": float(chosen_round)}
    for prefix, evaluation in (("test", chosen), ("test_last", last or {})):
        for model, stats in evaluation.get("summary", {}).items():
            for metric, s in stats.items():
                out.update({f"{prefix}/{model}/{metric}": s["mean"], f"{prefix}/{model}/{metric}_std": s["std"],
                            f"{prefix}/{model}/{metric}_worst": s["worst"]})  # fmt: skip
        out.update({f"{prefix}/pooled/{m}": v for m, v in evaluation.get("pooled", {}).items()})
    return out


def is_validation(evaluation: dict[str, Any]) -> bool:
    """Whether an evaluation scored the clients' validation sets (an evaluation round with a validation split)."""
    return evaluation.get("split") == "val"


def split_prefix(evaluation: dict[str, Any]) -> str:
    """The logged keys' first part: ``val`` for a validation evaluation, ``eval`` for a test one."""
    return "val" if is_validation(evaluation) else "eval"


def samples_trained(reply: Reply, batch_size: int, fixed_steps: bool) -> int:
    """Samples in the reply's batches: all full, except each epoch's last one when a client trains epochs."""
    if fixed_steps:  # the sampler draws exactly steps * batch_size samples
        return reply.num_steps * batch_size
    per_epoch = math.ceil(reply.num_samples / batch_size)
    epochs, rest = divmod(reply.num_steps, per_epoch)
    return epochs * reply.num_samples + rest * batch_size
