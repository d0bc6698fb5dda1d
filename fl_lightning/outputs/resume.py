"""Find the checkpoint that ``--federation.resume`` names, and refuse one that cannot continue this config."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fl_lightning.outputs.checkpoint import CHECKPOINT_DIR, find_last_checkpoint, list_checkpoints, load_checkpoint
from fl_lightning.outputs.config_diff import ALLOWED_TO_CHANGE, describe, diff_configs, load_saved_config
from fl_lightning.wire.protocol import POOLED


def resolve_resume(
    resume: str,
    output_dir: str | Path,
    run_name: str | None,
    config_dict: Mapping[str, Any] | None = None,
) -> tuple[Path, Path, dict[str, Any]]:
    """The run directory, checkpoint path and checkpoint content to resume from.

    Args:
        resume: ``"last"`` (the newest readable checkpoint of ``output_dir/run_name``, or, without a run name, of
            the run under ``output_dir`` with the newest checkpoint among those whose saved config matches
            ``config_dict``), a run directory, or a checkpoint file.
        output_dir: ``federation.output_dir``.
        run_name: ``federation.run_name``.
        config_dict: The resolved config of this command; when given, the run's ``config.yaml`` must not differ
            from it in a setting that changes what is trained (see :mod:`fl_lightning.outputs.config_diff`).

    Raises:
        FileNotFoundError: If nothing to resume from exists, naming where it looked.
        ValueError: If the run's saved config differs in a setting outside the allow-list (naming the keys), or,
            for ``last`` without a run name, if no run matches (listing the candidates and how they differ).

    """
    if resume == "last":
        if run_name is None:
            return _last_matching_run(Path(output_dir), config_dict)
        run_dir = Path(output_dir) / run_name
        found = find_last_checkpoint(run_dir)
        if found is None:
            raise FileNotFoundError(_nothing_to_resume("last", run_dir))
        check_resume_config(run_dir, config_dict)
        return run_dir, found[0], found[1]
    path = Path(resume)
    if path.is_dir():
        found = find_last_checkpoint(path)
        if found is None:
            raise FileNotFoundError(_nothing_to_resume(resume, path))
        check_resume_config(path, config_dict)
        return path, found[0], found[1]
    state = load_checkpoint(path)
    check_resume_config(path.parent.parent, config_dict)
    return path.parent.parent, path, state


def _nothing_to_resume(resume: str, run_dir: Path) -> str:
    """Why ``run_dir`` cannot be resumed, and what to do instead."""
    if not run_dir.is_dir():
        return f"federation.resume={resume}: there is no run directory {run_dir} to resume"
    written = list_checkpoints(run_dir)
    if not written:
        return (
            f"federation.resume={resume}: {run_dir} holds no round checkpoint (the run stopped before its first "
            "one): run the same command without --federation.resume to start it afresh (what the directory holds "
            "is moved aside)"
        )
    return (
        f"federation.resume={resume}: none of the {len(written)} round checkpoints in {run_dir / CHECKPOINT_DIR} is "
        "readable (the warnings above say why): resume from a copy of an intact one, or start a new run "
        "with another --federation.run_name"
    )


def _last_matching_run(output_dir: Path, config_dict: Mapping[str, Any] | None) -> tuple[Path, Path, dict[str, Any]]:
    """``resume=last`` without a run name: the newest run whose saved config matches ``config_dict``."""
    runs = [d for d in output_dir.glob("*") if d.is_dir() and list_checkpoints(d)]
    runs.sort(key=lambda d: list_checkpoints(d)[0].stat().st_mtime, reverse=True)
    rejected: list[str] = []
    for run_dir in runs:
        if config_dict is not None:
            reason = _mismatch(run_dir, config_dict)
            if reason is not None:
                rejected.append(f"  {run_dir.name}: {reason}")
                continue
        found = find_last_checkpoint(run_dir)
        if found is not None:
            return run_dir, found[0], found[1]
        rejected.append(f"  {run_dir.name}: no readable checkpoint")
    if not rejected:
        raise FileNotFoundError(f"federation.resume=last: no readable round checkpoint under {output_dir}")
    raise ValueError(
        f"federation.resume=last: no run under {output_dir} has a readable checkpoint and a config that matches this "
        "one; candidates, newest first:\n" + "\n".join(rejected) + "\nName the run to continue with "
        "--federation.run_name=<name> and its own settings (python train.py --config <run>/config.yaml ...)"
    )


def _mismatch(run_dir: Path, config_dict: Mapping[str, Any]) -> str | None:
    """Why ``run_dir`` cannot continue ``config_dict`` (None if it can)."""
    try:
        saved = load_saved_config(run_dir)
    except ValueError as err:
        return str(err)
    if saved is None:
        return "no config.yaml to compare with"
    refused = diff_configs(saved, config_dict).refused
    return f"differs in {', '.join(refused)}" if refused else None


def check_resume_config(run_dir: Path, config_dict: Mapping[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """Refuse to resume ``run_dir`` with a config that changes what is trained; return the allowed changes.

    Args:
        run_dir: The run directory (holding ``config.yaml``).
        config_dict: The resolved config of this command; None (a Federation built from Python without a
            config) skips the check.

    Returns:
        ``{dotted key: (saved, new)}`` of the differences in the allow-list (to be recorded in the run directory).

    Raises:
        ValueError: If the run has no ``config.yaml`` to compare with, or the configs differ outside the
            allow-list, naming every such key with both values.

    """
    if config_dict is None:
        return {}
    run_dir = Path(run_dir)
    saved = load_saved_config(run_dir)
    if saved is None:
        raise ValueError(f"cannot resume {run_dir}: it has no config.yaml to compare this config with")
    diff = diff_configs(saved, config_dict)
    if diff.refused:
        allowed = ", ".join(k.rstrip(".") for k in dict.fromkeys(ALLOWED_TO_CHANGE))
        raise ValueError(
            f"cannot resume {run_dir}: this config differs from its config.yaml in settings that change what is "
            f"trained (saved -> now):\n{describe(diff.refused)}\n"
            f"Resume with the saved settings (python train.py --config {run_dir / 'config.yaml'} "
            f"--federation.run_name={run_dir.name} --federation.resume=last) or start a new run. "
            f"Only these may change on resume: {allowed}."
        )
    return diff.allowed


def check_clients_match(checkpoint_state: Mapping[str, Any], client_ids: Sequence[str]) -> None:
    """Refuse a checkpoint written for other clients than the datamodule's (e.g. another ``data.num_clients``).

    The checkpoint's data-sampler state (``runtime.data``, else a top-level ``data`` entry) holds one entry per
    client of the run that wrote it and the pooled sampler; without it the members of the model groups are
    compared.

    Args:
        checkpoint_state: The loaded round checkpoint.
        client_ids: The datamodule's client ids.

    Raises:
        ValueError: Naming both client lists.

    """
    # Why a top-level "data" entry: the layout of checkpoints written before the client/server boundary.
    samplers = (checkpoint_state.get("runtime") or {}).get("data", checkpoint_state.get("data"))
    if samplers is not None:
        saved = [c for c in samplers if c != POOLED]
    else:
        saved = list(dict.fromkeys(c for g in checkpoint_state.get("groups", []) for c in g["members"] if c != POOLED))
    if sorted(saved) != sorted(client_ids):
        raise ValueError(
            f"the checkpoint was written for {len(saved)} clients [{_names(saved)}] but the data has "
            f"{len(client_ids)} clients [{_names(list(client_ids))}]: resume with the run's data settings "
            "(data.num_clients, the data source and partition)"
        )


def _names(ids: list[str], limit: int = 12) -> str:
    """Client ids for a message, abbreviated in the middle when there are many."""
    if len(ids) <= limit:
        return ", ".join(ids)
    return ", ".join(ids[: limit // 2]) + ", ..., " + ", ".join(ids[-2:])
