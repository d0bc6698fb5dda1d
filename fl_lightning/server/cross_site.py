"""Cross-site evaluation: every client's own model scored on every client's test set, and on all of them pooled.

What medical consortia run first (NVFlare's ``CrossSiteModelEval``): does hospital A's model work at hospital B?
A client's own model is its group's model with the client's private state (in ``local`` mode, its whole model; with
FedBN, the shared layers with its own norms). The model travels to the other sites as a state in an ``evaluate``
task; each site scores it on its own test set and returns its metrics (and, in a simulation, the predictions
the pooled metrics need).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_lightning.callback import ModelGroup
from fl_lightning.outputs.plots import plot_node_matrix
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import POOLED, Task

if TYPE_CHECKING:
    from fl_lightning.clients.base import ClientModule
    from fl_lightning.config import FederationConfig
    from fl_lightning.wire.transport import Transport

CROSS_SITE_CSV = "cross_site.csv"
CROSS_SITE_PNG = "cross_site.png"
POOLED_COLUMN = "pooled"  # the test column of a model on all test sets together


def own_models(transport: Transport, groups: dict[str, ModelGroup], ids: list[str], round_idx: int) -> dict[str, Any]:
    """Each client's own model, one ``take_private`` each.

    Its whole personal model where it has one (Ditto, MR-MTL, APFL), else its group's state with its private state.
    """
    take = [Task(protocol.TAKE_PRIVATE, round_idx, c, groups[c].name, options={"own": True}) for c in ids]
    held = {t.client_id: reply.state or {} for t, reply in zip(take, transport.stream(take))}
    return {c: {**groups[c].state, **held[c]} for c in ids}


def cross_site_matrix(
    transport: Transport,
    models: dict[str, Any],
    ids: list[str],
    round_idx: int,
    split: str = "test",
    module: ClientModule | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """``matrix[model's client][test client]`` = the metrics of that model on that client's ``split`` set.

    With ``module`` (a simulation, where the predictions may leave the sites), each row also has ``pooled``: the
    model on every test set together, computed from the same pass (the module's ``evaluation_parts``).
    """
    options = {"global": True, "personal": False, "split": split, "outputs": module is not None}
    matrix: dict[str, dict[str, dict[str, float]]] = {}
    for holder in ids:
        tasks = [Task(protocol.EVALUATE, round_idx, t, POOLED, state=models[holder], options=options) for t in ids]
        replies = list(transport.stream(tasks))
        matrix[holder] = {t.client_id: reply.metrics["global"] for t, reply in zip(tasks, replies)}
        parts = [r.payloads["outputs"] for r in replies if r.payloads.get("outputs")]
        if module is not None and parts:
            matrix[holder][POOLED_COLUMN] = module.metrics_from_parts(module.merge_parts(parts))
    return matrix


def write_cross_site(
    matrix: dict[str, dict[str, dict[str, float]]], run_path: Path, metric: str, round_: int, plot: bool = True
) -> None:
    """``cross_site.csv`` (one row per model, test set and metric) and, with ``plot``, ``cross_site.png``.

    The figure is the ``metric`` heat map; ``federation.plots=false`` leaves it out, as every other figure.
    """
    with (run_path / CROSS_SITE_CSV).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "model", "test", "metric", "value"])
        for holder, row in matrix.items():
            for target, metrics in row.items():
                for name, value in sorted(metrics.items()):
                    writer.writerow([round_, holder, target, name, value])
    if plot:
        plot_node_matrix(matrix, run_path / CROSS_SITE_PNG, metric, who="client")


def read_cross_site(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """``matrix[model][test][metric]`` from a ``cross_site.csv``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            out.setdefault(row["model"], {}).setdefault(row["test"], {})[row["metric"]] = float(row["value"])
    return out


def wanted(config: FederationConfig) -> bool:
    """Whether the run ends with a cross-site evaluation: ``federation.cross_site``, by default in ``local`` mode."""
    if config.cross_site is None:
        return config.mode == "local"
    return config.cross_site and config.topology != "peer_to_peer"  # peer-to-peer runs have node_matrix


def reported_groups(
    groups: list[ModelGroup], round_: int, chosen_round: int | None, best_groups: list[ModelGroup] | None
) -> tuple[list[ModelGroup], int]:
    """The groups whose models a run reports, and their round.

    The last round's, or (``select: best``) the chosen round's under their KEPT names, as the final test scores them
    (the clients keep that round's private states under the same names).
    """
    if chosen_round is None or chosen_round == round_:
        return groups, round_
    kept = [ModelGroup(protocol.KEPT + g.name, g.state, g.members, g.subsets) for g in best_groups or []]
    return kept, chosen_round
