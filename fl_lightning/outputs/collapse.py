"""Signs that training degenerated, read from what a run records (pure functions, plus two warning helpers).

A federated run can end with exit code 0 and have learned nothing: a model that predicts the majority class
everywhere reaches the majority-class rate as accuracy (0.85 on a 15 % / 85 % binary task), and a diverging
method whose weights stay finite is never counted as a failed client. These checks make both visible:

* **single class**: the global model predicts one class for the whole pooled test set (although that set holds
  more than one class);
* **balanced accuracy at chance**: pooled balanced accuracy ≤ 1 / ``num_classes`` + ``margin``;
* **training loss growth**: some round's mean training loss is ``factor`` times (default 100, two orders of
  magnitude) the first round's;
* **single class on some sites**: the global model predicts one class on a client's test set although that set
  holds several (``single_class_clients``), even when the pooled test set hides it;
* **no foreground** (segmentation): a client's foreground Dice is 0, as a model that predicts background
  everywhere scores (``zero_dice_clients``);
* **degenerate evaluation rounds**: rounds in which the global model predicted a single class (or no foreground)
  on every evaluated client (``degenerate_rounds``), recorded even when a later round recovered.

Each check is ``None`` when the run records nothing to decide it (segmentation has no balanced accuracy; local,
peer-to-peer and multi-model runs have no pooled evaluation; centralised runs record no per-client train loss).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# A collapsed model scores exactly chance; a model that learned a little on a small test set scores just above.
# 0.02 separates the two on the embedded digits (binary and 10-class) without flagging runs that did train.
CHANCE_MARGIN = 0.02
# "Orders of magnitude": 100x the round-1 loss. Ordinary training never comes near it (losses fall), while the
# SCAFFOLD divergence this is for went from ~1 to 122 by round 11 and 2.4e7 by round 20.
LOSS_GROWTH = 100.0


class DegenerateTrainingWarning(UserWarning):
    """A run finished, but what it trained (or the data it was evaluated on) cannot be trusted."""


class _HasTestSets(Protocol):
    client_ids: Iterable[str]

    def num_test_samples(self, client_id: str) -> int: ...


@dataclass(frozen=True)
class Collapse:
    """Result of :func:`detect_collapse`; a check is ``None`` when it could not be made.

    Attributes:
        single_class_predictions: The global model predicts one class on the whole pooled test set.
        balanced_acc_at_chance: Pooled balanced accuracy is at most chance (1 / num_classes) + margin.
        train_loss_growth: The mean training loss of some round grew ``factor``-fold over round 1's.
        messages: One readable sentence per detected problem.
        foreground_everywhere_clients: Segmentation clients whose model paints foreground nearly everywhere.

    """

    single_class_predictions: bool | None = None
    balanced_acc_at_chance: bool | None = None
    train_loss_growth: bool | None = None
    single_class_clients: tuple[str, ...] | None = None
    zero_dice_clients: tuple[str, ...] | None = None
    degenerate_rounds: tuple[int, ...] | None = None
    messages: tuple[str, ...] = field(default_factory=tuple)
    foreground_everywhere_clients: tuple[str, ...] | None = None

    @property
    def detected(self) -> bool:
        """Whether any check of the final models fired (degenerate rounds a run recovered from do not count)."""
        return bool(
            self.single_class_predictions
            or self.balanced_acc_at_chance
            or self.train_loss_growth
            or self.single_class_clients
            or self.zero_dice_clients
            or self.foreground_everywhere_clients
        )

    def as_dict(self) -> dict[str, Any]:
        """The ``collapse`` entry of ``summary.json``."""
        listed = lambda v: None if v is None else list(v)  # noqa: E731
        return {
            "detected": self.detected,
            "single_class_predictions": self.single_class_predictions,
            "balanced_acc_at_chance": self.balanced_acc_at_chance,
            "train_loss_growth": self.train_loss_growth,
            "single_class_clients": listed(self.single_class_clients),
            "zero_dice_clients": listed(self.zero_dice_clients),
            "foreground_everywhere_clients": listed(self.foreground_everywhere_clients),
            "degenerate_rounds": listed(self.degenerate_rounds),
            "messages": list(self.messages),
        }


def mean_train_loss_by_round(client_rows: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """Mean ``train_loss`` over the clients that trained in each round (rows of ``metrics.csv``), by round.

    Rows without a finite ``train_loss`` (clients not selected, or failed) are left out; rounds without any
    are absent from the result.
    """
    sums: dict[int, list[float]] = {}
    for row in client_rows:
        loss = row.get("train_loss")
        if loss is None or loss == "":
            continue
        value = float(loss)
        if math.isfinite(value):
            sums.setdefault(int(row["round"]), []).append(value)
    return {r: sum(v) / len(v) for r, v in sorted(sums.items())}


def single_class_predictions(pooled: Mapping[str, float]) -> bool | None:
    """Whether the model predicted one class for every pooled test image; ``None`` without the numbers.

    Needs ``predicted_classes`` (distinct predicted classes) and ``auroc`` from
    :func:`fl_lightning.clients.metrics.classification_metrics`: AUROC is NaN exactly when the test set holds a single
    class, and then predicting one class is right, not a collapse.
    """
    predicted, auroc = pooled.get("predicted_classes"), pooled.get("auroc")
    if predicted is None or auroc is None:
        return None
    return int(predicted) == 1 and not math.isnan(auroc)


def _number(value: Any) -> float | None:
    """A metric as a float (rows read back from a CSV hold strings; an empty cell is no value)."""
    if value is None or value == "":
        return None
    number = float(value)
    return None if math.isnan(number) else number


def single_class_clients(per_client: Mapping[str, Mapping[str, Any]]) -> list[str] | None:
    """Clients on whose test set the model predicts one class although the set holds several; None without numbers.

    As :func:`single_class_predictions`, per client: ``predicted_classes`` 1 and a defined ``auroc`` (AUROC is NaN
    exactly when the test set holds a single class).
    """
    decided = {c: m for c, m in per_client.items() if _number(m.get("predicted_classes")) is not None}
    if not decided:
        return None
    several = {c: m for c, m in decided.items() if _number(m.get("auroc")) is not None}  # AUROC NaN: one class held
    return [c for c, m in several.items() if _number(m["predicted_classes"]) == 1]


def zero_dice_clients(per_client: Mapping[str, Mapping[str, Any]]) -> list[str] | None:
    """Segmentation: clients whose foreground Dice is 0 (no predicted foreground overlaps a mask); None without Dice."""
    decided = {c: _number(m.get("dice")) for c, m in per_client.items()}
    decided = {c: d for c, d in decided.items() if d is not None}
    if not decided:
        return None
    return [c for c, d in decided.items() if d == 0.0]


#: A segmentation model that predicts foreground on at least this fraction of a test set's pixels while its
#: foreground Dice stays below FOREGROUND_DICE paints foreground everywhere (the mirror of zero Dice).
FOREGROUND_EVERYWHERE = 0.95
FOREGROUND_DICE = 0.5


def foreground_everywhere_clients(per_client: Mapping[str, Mapping[str, Any]]) -> list[str] | None:
    """Segmentation: clients whose model paints (nearly) every pixel foreground without matching the masks.

    ``predicted_foreground`` ≥ :data:`FOREGROUND_EVERYWHERE` and foreground Dice < :data:`FOREGROUND_DICE` (a
    test set that is almost all foreground would score a high Dice, and is not flagged). None without the numbers.
    """
    decided = {c: (_number(m.get("predicted_foreground")), _number(m.get("dice"))) for c, m in per_client.items()}
    decided = {c: (f, d) for c, (f, d) in decided.items() if f is not None and d is not None}
    if not decided:
        return None
    return [c for c, (f, d) in decided.items() if f >= FOREGROUND_EVERYWHERE and d < FOREGROUND_DICE]


def degenerate_rounds(client_rows: Iterable[Mapping[str, Any]], model: str = "global") -> list[int] | None:
    """Evaluation rounds in which ``model`` predicted one class (or no foreground) on every evaluated client.

    Args:
        client_rows: The rows of ``metrics.csv``.
        model: The model whose columns (``<model>/predicted_classes``, ``<model>/auroc``, ``<model>/dice``) are read.

    Returns:
        The rounds, in order; None when no row holds the numbers to decide.
    """
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for row in client_rows:
        metrics = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith(f"{model}/")}
        if any(_number(v) is not None for v in metrics.values()):
            by_round.setdefault(int(row["round"]), {})[str(row["client"])] = metrics
    if not by_round:
        return None
    out = []
    for r, per_client in sorted(by_round.items()):
        single, zero = single_class_clients(per_client), zero_dice_clients(per_client)
        bad = single if single is not None else zero
        decided = per_client if single is None else {c: m for c, m in per_client.items() if _number(m.get("auroc"))}
        if bad is not None and decided and len(bad) == len(decided):
            out.append(r)
    return out


def balanced_acc_at_chance(
    pooled: Mapping[str, float], num_classes: int | None, margin: float = CHANCE_MARGIN
) -> bool | None:
    """Whether pooled balanced accuracy is at most ``1 / num_classes + margin``; ``None`` without the numbers."""
    bacc = pooled.get("balanced_acc")
    if bacc is None or num_classes is None or num_classes < 2 or math.isnan(bacc):
        return None
    return bacc <= 1.0 / num_classes + margin


def loss_growth(losses: Mapping[int, float], factor: float = LOSS_GROWTH) -> tuple[int, float, float] | None:
    """The first round whose mean training loss is at least ``factor`` times the first round's.

    Args:
        losses: Mean training loss by round (:func:`mean_train_loss_by_round`).
        factor: Growth that counts as divergence.

    Returns:
        ``(round, its loss, the first round's loss)``, or ``None`` if no round grew that much.

    """
    if not losses:
        return None
    first_round = min(losses)
    reference = losses[first_round]
    for r, loss in sorted(losses.items()):
        if r > first_round and loss >= factor * max(reference, 1e-12):
            return r, loss, reference
    return None


#: How the messages name the model each client is judged by.
MODEL_WORDS = {"global": "global model", "personal": "personal model (each client's own, as it is evaluated)"}


def judged_model(evaluation: Mapping[str, Any]) -> str:
    """``personal`` where the evaluation has the clients' own models, else ``global``.

    Each client is judged by the model it uses: with private state (FedBN's norm layers, a fine-tuned head) that is
    its personal model, and a global model that is poor at a site is not a collapse there. Without private state
    the personal metrics equal the global ones, and the global model is named.
    """
    clients = evaluation.get("clients") or {}
    personal, global_ = clients.get("personal") or {}, clients.get("global") or {}
    return "personal" if personal and not _same_metrics(personal, global_) else "global"


def _same_metrics(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Per-client metrics equal value for value, NaN equal to NaN (a decoded copy holds other NaN objects)."""

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, Mapping) and isinstance(y, Mapping):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            return True
        return x == y

    return same(a, b)


def detect_collapse(
    evaluation: Mapping[str, Any],
    client_rows: Iterable[Mapping[str, Any]] | None = None,
    num_classes: int | None = None,
    *,
    margin: float = CHANCE_MARGIN,
    factor: float = LOSS_GROWTH,
) -> Collapse:
    """Run every check on a run's last evaluation and its per-client rows.

    Args:
        evaluation: The last evaluation (its ``pooled`` entry is the global model on the pooled test set).
        client_rows: The rows of ``metrics.csv`` (``round``, ``client``, ``train_loss``, …); None skips the
            loss check.
        num_classes: Number of classes (the chance level of balanced accuracy is 1 / num_classes).
        margin: How far above chance balanced accuracy still counts as chance.
        factor: Growth of the mean training loss over round 1 that counts as divergence.

    Returns:
        The checks and a message for each that fired.

    """
    pooled = evaluation.get("pooled") or {}
    messages: list[str] = []
    single = single_class_predictions(pooled)
    if single:
        messages.append(
            f"the global model predicts a single class for the whole pooled test set (accuracy "
            f"{pooled.get('acc', math.nan):.3f} is the rate of that class, balanced accuracy "
            f"{pooled.get('balanced_acc', math.nan):.3f}): training collapsed"
        )
    chance = balanced_acc_at_chance(pooled, num_classes, margin)
    if chance and not single:  # a single predicted class scores chance by construction: one message says it
        messages.append(
            f"balanced accuracy on the pooled test set is {pooled['balanced_acc']:.3f}, at chance "
            f"(1/{num_classes} = {1 / num_classes:.3f}): the model does not tell the classes apart"
        )
    growth = None
    if client_rows is not None:
        losses = mean_train_loss_by_round(client_rows)
        grown = loss_growth(losses, factor)
        growth = grown is not None if losses else None
        if grown is not None:
            r, loss, reference = grown
            messages.append(
                f"the mean training loss grew from {reference:.4g} (round {min(losses)}) to {loss:.4g} (round {r}), "
                f"{loss / max(reference, 1e-12):.3g}x: training diverged (weights stayed finite, so no client "
                f"was counted as failed)"
            )
    model = judged_model(evaluation)
    per_client = (evaluation.get("clients") or {}).get(model) or {}
    whose = MODEL_WORDS[model]
    sites = single_class_clients(per_client)
    if sites and len(sites) < len(per_client) or (sites and not single):
        messages.append(
            f"the {whose} predicts a single class on the test set of {len(sites)} of {len(per_client)} "
            f"client(s) although each holds several: {', '.join(sites)}"
        )
    empty = zero_dice_clients(per_client)
    if empty:
        messages.append(
            f"foreground Dice is 0 on {len(empty)} of {len(per_client)} client(s): {', '.join(empty)} (the model "
            "predicts no foreground that overlaps the masks: background everywhere)"
        )
    painted = foreground_everywhere_clients(per_client)
    if painted:
        messages.append(
            f"the {whose} predicts foreground on at least {FOREGROUND_EVERYWHERE:.0%} of the pixels of "
            f"{len(painted)} of {len(per_client)} client(s) with a foreground Dice below {FOREGROUND_DICE}: "
            f"{', '.join(painted)} (foreground everywhere)"
        )
    rounds = degenerate_rounds(client_rows, model) if client_rows is not None else None
    if rounds:
        last = max(int(row["round"]) for row in client_rows) if client_rows else None
        recovered = last is not None and rounds[-1] < last
        what = "one class" if per_client and single_class_clients(per_client) is not None else "no foreground"
        messages.append(
            f"the {whose} predicted {what} on every evaluated client in round(s) {_ranges(rounds)}"
            + (" before it recovered" if recovered else "")
        )
    return Collapse(
        single, chance, growth,
        None if sites is None else tuple(sites),
        None if empty is None else tuple(empty),
        None if rounds is None else tuple(rounds),
        tuple(messages),
        None if painted is None else tuple(painted),
    )  # fmt: skip


def _ranges(rounds: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``1-3, 5``."""
    parts, start = [], rounds[0]
    for previous, r in zip(rounds, [*rounds[1:], None]):
        if r != previous + 1:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = r
    return ", ".join(parts)


def clients_without_test(data: _HasTestSets) -> list[str]:
    """Ids of the clients whose test set is empty (e.g. a client with 1 image under a Dirichlet(0.1) split)."""
    return [cid for cid in data.client_ids if data.num_test_samples(cid) == 0]


def no_test_message(client_ids: list[str]) -> str:
    """The warning for clients without test images (they drop out of every per-client test metric)."""
    names = ", ".join(client_ids)
    return (
        f"{len(client_ids)} client(s) have no test images and are left out of every per-client test metric: "
        f"{names}. Fewer clients, a larger Dirichlet alpha or a larger test_fraction give every client a test set."
    )


def warn_clients_without_test(data: _HasTestSets) -> list[str]:
    """Warn (once, at the start of a run) about clients without test images; returns their ids."""
    empty = clients_without_test(data)
    if empty:
        warnings.warn(no_test_message(empty), DegenerateTrainingWarning, stacklevel=2)
    return empty


def warn_collapse(summary: Mapping[str, Any]) -> list[str]:
    """Warn once per message of a summary's ``collapse`` entry (see ``records.summary_table``); returns them."""
    messages = list((summary.get("collapse") or {}).get("messages", []))
    for message in messages:
        warnings.warn(message, DegenerateTrainingWarning, stacklevel=2)
    return messages
