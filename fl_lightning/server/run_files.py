"""The run directory as the server opens and closes it: a new run, a resumed one, the final summary and figures."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from datamodules.base import FederatedDataModule
from fl_lightning.config import FederationConfig
from fl_lightning.outputs import collapse
from fl_lightning.outputs.environment import environment_record
from fl_lightning.outputs.plots import domain_counts, plot_curves, plot_node_matrix, plot_partition
from fl_lightning.outputs.resume import check_clients_match, check_resume_config, resolve_resume
from fl_lightning.outputs.run_dir import RunDirectory
from fl_lightning.outputs.sites import plot_sites, site_examples


def new_run_directory(
    cfg: FederationConfig, config_text: str | None, seed: int, data: FederatedDataModule, partition: bool
) -> RunDirectory:
    """A fresh run directory with ``config.yaml``, ``environment.json`` and (``partition``) the data's figures.

    The figures, written only where the server holds the data (a simulation), are ``partition.png`` (labels and
    sites per client) and, for images, ``sites.png`` (example training images per client).
    """
    run_dir = RunDirectory(cfg.output_dir, cfg.run_name, suffix=cfg.mode)
    if config_text is not None:
        run_dir.write_config(config_text)
    run_dir.write_json("environment.json", environment_record(seed))
    if partition:
        ids = list(data.client_ids)
        counts = {c: data.label_counts(c).numpy() for c in ids}
        masks = getattr(data, "label_kind", "class") == "class" and data.client_data(ids[0]).train_y.ndim > 1
        unit = "pixels" if masks else "samples"  # masks count pixels; survival labels are (time, event) pairs
        plot_partition(counts, run_dir.path / "partition.png", domain_counts(data), unit)
        if getattr(data, "sample_kind", "image") == "image":  # a table's rows are no pictures
            plot_sites(site_examples(data), run_dir.path / "sites.png", len(ids), data.label_names())
    return run_dir


def resumed_run_directory(
    cfg: FederationConfig,
    config_dict: Mapping[str, Any] | None,
    client_ids: Sequence[str],
    restore: Callable[[dict[str, Any]], int],
    note: Callable[[str], None],
) -> tuple[RunDirectory, str | None]:
    """The run directory ``cfg.resume`` names, cut back to its checkpoint, and the logger run id to continue.

    Args:
        cfg: The ``federation:`` settings (``resume``, ``output_dir``, ``run_name``, ``rounds``).
        config_dict: This command's resolved config (compared with the run's ``config.yaml``).
        client_ids: This run's clients (they must be the checkpoint's).
        restore: Loads the checkpoint's state into the server; returns the round it is after.
        note: Prints the terminal's note of where the run resumes.

    Raises:
        ValueError: If the checkpoint's clients or the run's config do not match this command's.
    """
    path, ckpt_path, state = resolve_resume(cfg.resume, cfg.output_dir, cfg.run_name, config_dict)
    check_clients_match(state, client_ids)
    changes = check_resume_config(path, config_dict)  # the allow-listed changes, to record
    after = restore(state)
    if "rows" in state:  # written before checkpoints held only the row counts: the rows themselves
        run_dir = RunDirectory.reopen(path, state["rows"]["clients"], state["rows"]["rounds"])
    else:  # the CSVs are the source, cut back to what this checkpoint counts
        run_dir = RunDirectory.resume(path, state["row_counts"])
    run_dir.record_resume(ckpt_path, after, changes)
    note(f"resuming from {ckpt_path} after round {after}")
    if cfg.rounds <= after:
        warnings.warn(
            f"federation.rounds={cfg.rounds} but the checkpoint is after round {after}: no round is trained, only "
            f"the final evaluation of round {after}'s models runs (raise federation.rounds to continue training)",
            stacklevel=3,
        )
    return run_dir, state.get("logger_run_id")


def write_final_outputs(run_dir: RunDirectory, summary: dict[str, Any], plots: bool, primary_metric: str) -> None:
    """``summary.json``, a warning if the run collapsed, and (``plots``) ``curves.png`` and ``node_matrix.png``."""
    run_dir.write_summary(summary)
    collapse.warn_collapse(summary)
    if plots:
        plot_curves(run_dir.client_rows, run_dir.path / "curves.png", primary_metric)
        if "node_matrix" in summary:
            plot_node_matrix(summary["node_matrix"], run_dir.path / "node_matrix.png", primary_metric)
