"""Empirical privacy audit of a finished run: membership inference on its final models.

An attacker holding the final model (the global one, or a client's personalised one) and a sample tries to tell
whether the sample was in a client's training set. The audit measures how well two attacks do, next to the ε a
differentially private run reports (ε bounds every attack; these are two concrete ones, so a low AUC here is no
proof of privacy, while a high one shows a leak):

- ``loss`` (Yeom et al. 2018, "Privacy risk in machine learning"): score s(x, y) = −ℓ(x, y), the negative
  cross-entropy of the sample under the model; training samples tend to have a lower loss.
- ``class_calibrated`` (difficulty calibration in the spirit of Watson et al. 2022, without reference models):
  s(x, y) = −(ℓ(x, y) − μ_{c,y}), where μ_{c,y} is the mean loss of client c's held-out samples of class y (a
  held-out sample's own loss is left out of its μ; a class without other held-out samples falls back to all of
  the client's other held-out samples). It removes how hard a class (and a client's imaging style) is in general,
  so it separates "seen" from "easy".

Members are each client's training samples, non-members the same client's test samples (never trained on, from
the same distribution). The two sets are balanced per client: the larger is subsampled to the size of the smaller
(and both to ``--max-samples``) with a generator seeded by ``--seed`` and the client id, so the audit is exact and
repeatable and chance level is AUC 0.5. Reported per attack: the AUC pooled over clients, the AUC per client (mean
and worst = highest), the attack advantage max(TPR − FPR) (Yeom et al.'s membership advantage) and the TPR at
FPR ≤ 1 % (with n non-members, 1 % FPR allows only ⌊n/100⌋ false positives: below 100 non-members none at all,
so the number is coarse on small data).

Classification runs only (``ClassificationClient``); a segmentation run is refused. Runs with sample-level model
groups (one client training several models on parts of its data) are refused too::

    python -m fl_lightning.tools.membership_audit RUN_DIR [--model global|personal] [--max-samples N] [--write]
        [--live]

``--write`` adds the result to the run's ``summary.json`` under ``membership_audit`` (atomically; the rest of the
file is unchanged). The table names the checkpoint and round audited. A run still being written by another process
is refused (its newest checkpoint is not the final model; ``--live`` audits it anyway, with a note saying so), and
a run stopped before its last round gets a note that its round is not the final one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from datamodules.sampler import stable_seed
from fl_lightning.outputs.checkpoint import CHECKPOINT_DIR, find_last_checkpoint, list_checkpoints
from fl_lightning.outputs.run_dir import LOCK_NAME, RunDirectoryInUse, claim, release, write_json

SUMMARY_KEY = "membership_audit"
ATTACKS = ("loss", "class_calibrated")
LOW_FPR = 0.01


# ---------------------------------------------------------------------------------------------------- the maths
def balanced_indices(
    n_members: int, n_nonmembers: int, seed: int, max_samples: int | None = None
) -> tuple[Tensor, Tensor]:
    """Indices of equally many members and non-members: the larger set is subsampled, without replacement.

    Args:
        n_members: Size of the member set.
        n_nonmembers: Size of the non-member set.
        seed: Seed of the subsampling (its own generator: the global RNG is untouched).
        max_samples: Cap on each side (None: no cap).

    Returns:
        Sorted int64 indices into the member set and into the non-member set, both of length
        ``min(n_members, n_nonmembers, max_samples)``; a set of exactly that size is kept whole, in order.

    """
    n = min(n_members, n_nonmembers, max_samples if max_samples is not None else n_members)
    gen = torch.Generator().manual_seed(seed)

    def pick(size: int) -> Tensor:
        if size == n:
            return torch.arange(n)
        return torch.randperm(size, generator=gen)[:n].sort().values

    return pick(n_members), pick(n_nonmembers)


def attack_metrics(member_scores: Tensor, nonmember_scores: Tensor, low_fpr: float = LOW_FPR) -> dict[str, float]:
    """How well a score separates members (higher score = "member") from non-members.

    Args:
        member_scores: Attack scores of members (N,).
        nonmember_scores: Attack scores of non-members (M,).
        low_fpr: The false-positive rate at which the TPR is read.

    Returns:
        ``auc`` (scikit-learn's ROC AUC, ties counted half), ``advantage`` (max over thresholds of TPR − FPR),
        ``tpr_at_low_fpr`` (the highest TPR with FPR ≤ ``low_fpr``), ``members``, ``nonmembers`` and
        ``low_fpr_false_positives`` (how many non-members ``low_fpr`` lets pass: ⌊low_fpr · M⌋). NaN metrics when
        either set is empty.

    """
    from sklearn.metrics import roc_auc_score, roc_curve

    n, m = len(member_scores), len(nonmember_scores)
    out = {"members": n, "nonmembers": m, "low_fpr_false_positives": math.floor(low_fpr * m + 1e-9)}
    if n == 0 or m == 0:
        return {"auc": math.nan, "advantage": math.nan, "tpr_at_low_fpr": math.nan, **out}
    labels = np.concatenate([np.ones(n), np.zeros(m)])
    scores = torch.cat([member_scores, nonmember_scores]).double().numpy()
    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    return {
        "auc": float(roc_auc_score(labels, scores)),
        "advantage": float(np.max(tpr - fpr)),
        "tpr_at_low_fpr": float(tpr[fpr <= low_fpr + 1e-12].max()),  # roc_curve starts at (0, 0): never empty
        **out,
    }


def class_calibrated_scores(
    member_loss: Tensor,
    member_y: Tensor,
    reference_loss: Tensor,
    reference_y: Tensor,
    nonmember_idx: Tensor,
) -> tuple[Tensor, Tensor]:
    """Difficulty-calibrated scores −(ℓ − μ_y) of members and of the evaluated non-members.

    μ_y is the mean loss of the reference samples (all of the client's held-out samples, also those balancing left
    out) of class y. An evaluated non-member is itself a reference sample: its own loss is left out of its μ_y
    (leave-one-out), else it would pull its own calibrated score towards 0 and flatter the attack's FPR. A class
    with no (other) reference sample falls back to the mean of all (other) reference samples, and with none at all
    (a client with a single held-out sample) the score stays uncalibrated (μ = 0).

    Args:
        member_loss: Losses of the evaluated members (N,).
        member_y: Their labels (N,).
        reference_loss: Losses of all held-out samples of the client (R,).
        reference_y: Their labels (R,).
        nonmember_idx: Indices into the reference set of the evaluated non-members (M,).

    Returns:
        The members' scores (N,) and the evaluated non-members' scores (M,), float64.

    """
    ref_loss, ref_y = reference_loss.double(), reference_y.long()
    classes = int(torch.cat([member_y.long(), ref_y, torch.zeros(1, dtype=torch.long)]).max()) + 1
    sums = torch.zeros(classes, dtype=torch.float64).index_add_(0, ref_y, ref_loss)
    counts = torch.zeros(classes, dtype=torch.float64).index_add_(0, ref_y, torch.ones_like(ref_loss))
    total, count = ref_loss.sum(), float(len(ref_loss))

    def reference_mean(y: Tensor, own: Tensor | None) -> Tensor:
        s, c = sums[y], counts[y]
        t, k = total.expand_as(s), torch.full_like(s, count)
        if own is not None:  # leave the sample's own loss out
            s, c, t, k = s - own, c - 1, t - own, k - 1
        # A class without (other) reference samples: the client's overall mean; without any at all: no calibration
        overall = torch.where(k > 0, t / k.clamp(min=1), torch.zeros_like(t))
        return torch.where(c > 0, s / c.clamp(min=1), overall)

    members = -(member_loss.double() - reference_mean(member_y.long(), None))
    own = ref_loss[nonmember_idx]
    nonmembers = -(own - reference_mean(ref_y[nonmember_idx], own))
    return members, nonmembers


@torch.inference_mode()
def per_sample_losses(
    module: torch.nn.Module, x: Tensor, y: Tensor, device: torch.device, batch_size: int = 512
) -> Tensor:
    """Cross-entropy of every sample under ``module`` in eval mode (what a deployed model gives), on the CPU.

    Only the evaluation-time model is used: training-only loss modifiers (FedShift's logit adjustment, class
    weights, extra loss terms) are not part of what an attacker holding the model sees.
    """
    was_training = module.training
    module.eval().to(device)
    out = []
    for start in range(0, len(y), batch_size):
        logits = module(x[start : start + batch_size].to(device)).float()
        out.append(F.cross_entropy(logits, y[start : start + batch_size].to(device), reduction="none").cpu())
    module.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)


def _summarise(member: dict[str, Tensor], nonmember: dict[str, Tensor], low_fpr: float) -> dict[str, Any]:
    """One attack's metrics pooled over clients and per client (mean and worst = highest AUC)."""
    ids = list(member)
    pooled = attack_metrics(torch.cat([member[c] for c in ids]), torch.cat([nonmember[c] for c in ids]), low_fpr)
    per_client = {c: attack_metrics(member[c], nonmember[c], low_fpr) for c in ids}
    aucs = [r["auc"] for r in per_client.values() if not math.isnan(r["auc"])]
    worst = max(per_client, key=lambda c: -math.inf if math.isnan(per_client[c]["auc"]) else per_client[c]["auc"])
    return {
        **pooled,
        "client_auc_mean": float(np.mean(aucs)) if aucs else math.nan,
        "client_auc_worst": float(max(aucs)) if aucs else math.nan,
        "worst_client": worst if aucs else None,
        "per_client": {c: {k: r[k] for k in ("auc", "advantage", "members")} for c, r in per_client.items()},
    }


def audit_losses(
    losses: dict[str, dict[str, Tensor]],
    seed: int = 0,
    max_samples: int | None = None,
    low_fpr: float = LOW_FPR,
) -> dict[str, Any]:
    """Both attacks on per-client losses (the audit without a model: tests and other callers use it directly).

    Args:
        losses: Per client ``{"train_loss", "train_y", "test_loss", "test_y"}``: every training (member) and test
            (non-member) sample's loss and label.
        seed: Seed of the balancing (combined with the client id).
        max_samples: Cap on members and on non-members per client.
        low_fpr: The FPR at which the TPR is read.

    Returns:
        ``{"attacks": {name: metrics}, "samples_per_client": {client: n per side}}``.

    """
    member: dict[str, dict[str, Tensor]] = {a: {} for a in ATTACKS}
    nonmember: dict[str, dict[str, Tensor]] = {a: {} for a in ATTACKS}
    sizes = {}
    for cid, d in losses.items():
        mi, ni = balanced_indices(len(d["train_loss"]), len(d["test_loss"]), stable_seed(seed, "mia", cid), max_samples)
        sizes[cid] = len(mi)
        member["loss"][cid], nonmember["loss"][cid] = -d["train_loss"][mi].double(), -d["test_loss"][ni].double()
        cal = class_calibrated_scores(d["train_loss"][mi], d["train_y"][mi], d["test_loss"], d["test_y"], ni)
        member["class_calibrated"][cid], nonmember["class_calibrated"][cid] = cal
    attacks = {a: _summarise(member[a], nonmember[a], low_fpr) for a in ATTACKS}
    return {"attacks": attacks, "samples_per_client": sizes}


# ---------------------------------------------------------------------------------------------------- the run
def _rebuild(run: Path) -> tuple[Any, Path, dict[str, Any]]:
    """The run's CLI objects rebuilt from its ``config.yaml``, and its newest loadable checkpoint.

    Raises:
        FileNotFoundError: If the directory, its ``config.yaml`` or its round checkpoints are missing, naming them.
        RuntimeError: If checkpoints exist but none loads.
    """
    if not run.is_dir():
        raise FileNotFoundError(f"run directory not found: {run}")
    config = run / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{run} is not a run directory: {config} is missing")
    if not list_checkpoints(run):
        raise FileNotFoundError(
            f"{run} holds no round checkpoint ({run / CHECKPOINT_DIR}/round-NNNNN.ckpt): the audit needs the final "
            "model (a run with federation.checkpoint_every=0 keeps none)"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # damaged checkpoints are reported below if none loads
        found = find_last_checkpoint(run)
    if found is None:
        raise RuntimeError(f"none of the round checkpoints in {run / CHECKPOINT_DIR} loads")
    from fl_lightning.cli import build_cli  # the CLI imports the whole stack: only when a run is audited

    with warnings.catch_warnings():  # LightningCLI warns when sys.argv (this command's own flags) is also set
        warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter.*")
        cli = build_cli(["--config", str(config), "--trainer.logger=false"], log=False)
    return cli, found[0], found[1]


def client_states(state: dict[str, Any], client_ids: list[str], model: str) -> dict[str, dict[str, Tensor]]:
    """Each client's final model state in a round checkpoint: its group's global state (+ its private state).

    Args:
        state: The loaded checkpoint.
        client_ids: The clients to audit.
        model: ``global`` (the group's model) or ``personal`` (the group's model with the client's private state,
            e.g. FedBN's norm layers, over it).

    Raises:
        ValueError: If a client trains in several groups (sample-level groups) or in none.
    """
    from fl_lightning.wire.protocol import POOLED  # centralised training's one pseudo-client trains the model

    groups = state["groups"]
    private = state.get("runtime", {}).get("private", {})  # client -> group -> state
    out = {}
    for cid in client_ids:
        mine = [g for g in groups if cid in g["members"]] or [g for g in groups if POOLED in g["members"]]
        if len(mine) != 1 or mine[0].get("subsets"):
            raise ValueError(
                f"client {cid!r} trains in {len(mine)} model groups"
                + (" on sample subsets" if mine and mine[0].get("subsets") else "")
                + ": the membership audit needs one model per client's training set"
            )
        g = mine[0]
        out[cid] = dict(g["state"]) if model == "global" else {**g["state"], **private.get(cid, {}).get(g["name"], {})}
    return out


def _privacy_budget(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in ``summary.json`` whose key names ε or δ (a DP run's accountant), flattened, for the table."""
    found: dict[str, float] = {}
    for key, value in summary.items():
        if key == SUMMARY_KEY:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found.update(_privacy_budget(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if any(w in str(key).lower() for w in ("epsilon", "delta", "ε", "δ")):
                found[name] = float(value)
    return found


def audit(
    run: str | Path,
    model: str = "global",
    max_samples: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    write: bool = False,
    live: bool = False,
) -> dict[str, Any]:
    """Membership-inference audit of a run directory's final models.

    Args:
        run: The run directory (``config.yaml`` and ``checkpoints/``).
        model: ``global`` or ``personal`` (see :func:`client_states`).
        max_samples: Cap on members and on non-members per client (None: all that balancing keeps).
        seed: Seed of the balancing subsample.
        device: Where the losses are computed.
        write: Add the result to ``summary.json`` under ``membership_audit``.
        live: Audit a run that another process is still writing (its newest checkpoint), with a note.

    Returns:
        The result: attack metrics, the checkpoint and round audited, samples per client, settings and notes.

    Raises:
        FileNotFoundError: If the run directory, its config or its checkpoints are missing.
        ValueError: For an unsupported run (segmentation, sample-level groups, no global model for ``global``).
        RuntimeError: If another process is still writing the run (and ``live`` is not set), naming the round.

    """
    from fl_lightning.clients.classification import ClassificationClient

    if model not in ("global", "personal"):
        raise ValueError(f"model must be 'global' or 'personal', got {model!r}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    run = Path(run)
    cli, ckpt_path, state = _rebuild(run)
    module, data, cfg = cli.model, cli.datamodule, cli.config_init["federation"]
    if not isinstance(module, ClassificationClient):
        raise ValueError(
            f"{run}: the membership audit supports classification runs (ClassificationClient), this run's model is "
            f"{type(module).__name__}"
        )
    notes = _progress_notes(run, int(state["round"]), int(cfg.rounds), live)
    if model == "global" and (cfg.mode == "local" or cfg.topology == "peer_to_peer"):
        where = "mode local" if cfg.mode == "local" else "topology peer_to_peer"
        raise ValueError(f"{run} has no global model ({where}: every client keeps its own): use --model personal")
    from fl_lightning.callback import FederatedCallback

    # The callbacks' layers (HarmoFL's amplitude normalisation...) must exist for the checkpoint's keys to load.
    for cb in cli.trainer.callbacks:
        if isinstance(cb, FederatedCallback):
            cb.prepare_module(module, data)
    ids = list(data.client_ids)
    states = client_states(state, ids, model)
    if model == "personal" and not any(state.get("runtime", {}).get("private", {}).get(c) for c in ids):
        notes.append("the run keeps no private model state: the personal models are the global one")
    dev = torch.device(device)
    losses = {}
    for cid in ids:
        module.load_state_dict(states[cid])
        split = data.client_data(cid)
        losses[cid] = {
            "train_loss": per_sample_losses(module, split.train_x, split.train_y, dev),
            "train_y": split.train_y,
            "test_loss": per_sample_losses(module, split.test_x, split.test_y, dev),
            "test_y": split.test_y,
        }
    result = audit_losses(losses, seed=seed, max_samples=max_samples)
    result = {
        "model": model,
        "checkpoint": str(ckpt_path.relative_to(run)),
        "round": int(state["round"]),
        "seed": seed,
        "max_samples": max_samples,
        "members": "each client's training samples",
        "nonmembers": "the same client's test samples",
        "balancing": "per client, the larger set subsampled (seeded) to the size of the smaller",
        "low_fpr": LOW_FPR,
        **result,
        "notes": notes,
    }
    if write:
        write_summary_entry(run, result)
    return result


def _progress_notes(run: Path, done: int, planned: int, live: bool) -> list[str]:
    """Notes on how final the audited round is; refuses a run another process is writing unless ``live``.

    Raises:
        RuntimeError: If a live process holds the run directory and ``live`` is False.
    """
    try:
        newly = claim(run)
    except RunDirectoryInUse:
        pid = (run / LOCK_NAME).read_text(encoding="utf-8").strip() or "unknown"
        if not live:
            raise RuntimeError(
                f"{run} is being written by a live run (pid {pid}): its newest checkpoint is round {done} of "
                f"{planned}, not the final model. Audit it when the run has ended, or pass --live to audit round "
                f"{done} now"
            ) from None
        return [f"the run was still training (pid {pid}): this audits round {done} of {planned}, not the final model"]
    if newly:
        release(run)
    if done < planned and not (run / "summary.json").is_file():
        return [
            f"the run stopped after round {done} of {planned} (no summary.json): this audits round {done}; resume "
            "the run for its final model"
        ]
    return []


def write_summary_entry(run: Path, entry: dict[str, Any]) -> None:
    """Set ``summary.json``'s ``membership_audit`` to ``entry``, atomically, keeping every other entry as it is.

    Raises:
        FileNotFoundError: If the run has no ``summary.json`` (it is written when a run finishes).
        fl_lightning.outputs.run_dir.RunDirectoryInUse: If a live run holds the directory (it rewrites summary.json).
    """
    path = run / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: --write adds to the summary of a finished run")
    # A live run of another process would overwrite (or be overwritten by) our summary; this process's own run
    # (from Python) stays held after.
    newly = claim(run)
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        summary[SUMMARY_KEY] = entry
        write_json(path, summary)
    finally:
        if newly:
            release(run)


def format_table(result: dict[str, Any], budget: dict[str, float] | None = None) -> str:
    """The result as a small plain-text table (one row per attack)."""
    n = sum(result["samples_per_client"].values())
    lines = [
        f"membership inference on the {result['model']} model(s), {result['checkpoint']} (round {result['round']}): "
        f"{n} members vs {n} non-members over {len(result['samples_per_client'])} clients (balanced, seed "
        f"{result['seed']})",
        f"{'attack':<18} {'AUC':>6} {'client mean':>12} {'worst client':>20} {'advantage':>10} {'TPR@1%FPR':>10}",
    ]
    for name, r in result["attacks"].items():
        worst = f"{r['client_auc_worst']:.3f} ({r['worst_client']})"
        lines.append(
            f"{name:<18} {r['auc']:>6.3f} {r['client_auc_mean']:>12.3f} {worst:>20} {r['advantage']:>10.3f} "
            f"{r['tpr_at_low_fpr']:>10.3f}"
        )
    fp = next(iter(result["attacks"].values()))["low_fpr_false_positives"]
    lines.append(f"(chance: AUC 0.5, advantage 0; 1 % FPR of {n} non-members allows {fp} false positives)")
    for key, value in (budget or {}).items():
        lines.append(f"{key}: {value:g}")
    lines += [f"note: {note}" for note in result["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m fl_lightning.tools.membership_audit RUN_DIR``; prints the table and returns the result."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="run directory (config.yaml and checkpoints/)")
    parser.add_argument("--model", choices=("global", "personal"), default="global", help="which final model")
    parser.add_argument("--max-samples", type=int, help="at most this many members and non-members per client")
    parser.add_argument("--seed", type=int, default=0, help="seed of the balancing subsample")
    parser.add_argument("--device", default="cpu", help="where the losses are computed (e.g. cuda)")
    parser.add_argument("--write", action="store_true", help="add the result to summary.json as membership_audit")
    parser.add_argument("--live", action="store_true", help="audit a run still being written (its newest round)")
    ns = parser.parse_args(argv)
    # The rebuilt Trainer's "GPU available" lines say nothing about the audit (train.py quiets them alike).
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    try:
        result = audit(ns.run, ns.model, ns.max_samples, ns.seed, ns.device, ns.write, ns.live)
    except (FileNotFoundError, ValueError, RuntimeError) as err:  # the message names the fix: no traceback
        parser.exit(1, f"error: {err}\n")
    summary = ns.run / "summary.json"
    budget = _privacy_budget(json.loads(summary.read_text(encoding="utf-8"))) if summary.is_file() else {}
    print(format_table(result, budget))
    if ns.write:
        print(f"wrote {SUMMARY_KEY} to {summary}")
    return result


if __name__ == "__main__":
    main()
