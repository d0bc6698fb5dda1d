"""Regression anchor: seven shipped methods, 2–3 small rounds each, summarised as per-tensor sums and norms.

Frozen before the client/server boundary refactor (``regression_anchor.json``); after it the ``inprocess``
transport must reproduce the numbers (within the tolerances of test_regression_anchor.py, which say why; exact
hashes would break across CPUs).
Regenerate only when a change is meant to alter results: ``python -m tests.anchors.runs --write``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import yaml

from fl_lightning.cli import main
from fl_lightning.outputs.checkpoint import find_last_checkpoint

ANCHOR_FILE = Path(__file__).with_name("regression_anchor.json")

SMALL = [
    "--trainer.logger=false",
    "--federation.progress=false",
    "--federation.plots=false",
    "--data.image_size=8",
    "--model.width=4",
]

# name -> (config files, overlay written next to the run, extra arguments)
TWO_ROUNDS = ["--federation.rounds=2", "--data.max_samples_per_client=40"]
RUNS: dict[str, tuple[list[str], dict[str, Any] | None, list[str]]] = {
    "fedavg_digits": (["configs/fedavg_digits.yaml"], None, TWO_ROUNDS),
    "fedbn_fedprox_digits": (
        ["configs/fedavg_digits.yaml"],
        {"trainer": {"callbacks": [
            {"class_path": "callbacks.FedBN"},
            {"class_path": "callbacks.FedProx", "init_args": {"mu": 0.01}},
        ]}},
        ["--federation.rounds=2", "--data.max_samples_per_client=40"],
    ),
    "scaffold_digits_dirichlet": (
        ["configs/scaffold_digits_dirichlet.yaml"], None, ["--federation.rounds=2", "--data.max_samples_per_client=40"]
    ),
    "harmofl_digits": (["configs/harmofl_digits.yaml"], None, TWO_ROUNDS),
    "fedshift_digits_dirichlet": (
        ["configs/fedshift_digits_dirichlet.yaml"], None, ["--federation.rounds=2", "--data.max_samples_per_client=40"]
    ),
    "feder_digits": (
        ["configs/feder_digits.yaml"],
        {"trainer": {"callbacks": [{"class_path": "callbacks.ExperienceReplay", "init_args": {
            "buffer_size": 16, "replay_weight": 1.0, "gan": {"epochs": 1, "privacy_weight": 10.0},
        }}]}},
        ["--federation.rounds=2", "--data.max_samples_per_client=20"],
    ),
    "scfl_digits_seg": (
        ["configs/scfl_digits_seg.yaml"],
        {"trainer": {"callbacks": [
            {"class_path": "callbacks.DomainIsolation", "init_args": {
                "split_round": 1, "n_clusters": 2, "components_per_class": 2, "prune_fraction": 0.05,
                "chunk_size": 16, "seed": 0, "selector_rounds": 2, "selector_local_steps": 2, "plots": False,
            }},
            {"class_path": "callbacks.LRSchedule", "init_args": {"kind": "exponential", "gamma": 0.95}},
        ]}},
        ["--federation.rounds=3", "--data.num_clients=4", "--data.num_samples=80", "--data.image_size=16",
         "--model.width=4"],
    ),
}  # fmt: skip


def run_args(name: str, out: Path, extra: list[str] = ()) -> list[str]:
    """The ``train.py`` arguments of anchor run ``name`` writing to ``out/name``."""
    configs, overlay, args = RUNS[name]
    out.mkdir(parents=True, exist_ok=True)
    files = [f"--config={c}" for c in configs]
    if overlay is not None:
        path = out / f"{name}.overlay.yaml"
        path.write_text(yaml.safe_dump(overlay))
        files.append(f"--config={path}")
    return [*files, *SMALL, *args, f"--federation.output_dir={out}", f"--federation.run_name={name}", *extra]


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = float(value)


def final_states(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the final model states in a round checkpoint: groups' global states, clients' private ones and
    their whole personal models.

    Reads both checkpoint layouts: private state kept by the server (before the boundary) or by the client runtime.
    """
    tensors: dict[str, torch.Tensor] = {}
    for g in state["groups"]:
        for k, v in g["state"].items():
            tensors[f"global/{g['name']}/{k}"] = v
    private = state.get("private")
    if private is None:  # the runtime keys by client first: {client: {group: state}}
        private = {}
        for cid, groups in state["runtime"]["private"].items():
            for group, st in groups.items():
                private.setdefault(group, {})[cid] = st
    for group, per_client in private.items():
        for cid, st in per_client.items():
            for k, v in st.items():
                tensors[f"private/{group}/{cid}/{k}"] = v
    for cid, groups in state.get("runtime", {}).get("personal", {}).items():  # whole personal models (Ditto, APFL)
        for group, st in groups.items():
            for k, v in st.items():
                tensors[f"personal/{group}/{cid}/{k}"] = v
    return tensors


def describe(run_dir: Path) -> dict[str, Any]:
    """Per-tensor (sum, norm) of the final states, their sha256, and the numeric entries of summary.json."""
    found = find_last_checkpoint(run_dir)
    assert found is not None, f"no checkpoint in {run_dir}"
    states = final_states(found[1])
    summary: dict[str, float] = {}
    full = json.loads((run_dir / "summary.json").read_text())
    _flatten("", {k: v for k, v in full.items() if k not in ("run_dir",)}, summary)
    digest = hashlib.sha256()
    for k in sorted(states):
        digest.update(k.encode())
        digest.update(states[k].detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return {
        "states": {k: [float(v.double().sum()), float(v.double().norm())] for k, v in sorted(states.items())},
        "summary": summary,
        "sha256": digest.hexdigest(),
    }


def run_and_describe(name: str, out: Path, extra: list[str] = ()) -> dict[str, Any]:
    """Run anchor ``name`` through ``train.py``'s main and describe its final state."""
    main(run_args(name, out, extra))
    return describe(out / name)


if __name__ == "__main__":
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="overwrite regression_anchor.json")
    parser.add_argument("--only", nargs="*", default=list(RUNS))
    parser.add_argument("--extra", nargs="*", default=[], help="more train.py arguments (e.g. a transport)")
    ns = parser.parse_args()
    import sys

    sys.argv = sys.argv[:1]  # LightningCLI reads sys.argv too
    torch.set_num_threads(1)
    anchor = json.loads(ANCHOR_FILE.read_text()) if ANCHOR_FILE.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ns.only:
            got = run_and_describe(name, Path(tmp), ns.extra)
            same = anchor.get(name, {}).get("sha256") == got["sha256"]
            print(f"{name}: sha256 {got['sha256'][:16]} {'== anchor' if same else '!= anchor'}")
            if ns.write:
                anchor[name] = got
    if ns.write:
        ANCHOR_FILE.write_text(json.dumps(anchor, indent=1, sort_keys=True) + "\n")
