"""Degenerate training on a binary, imbalanced task: why HarmoFL collapsed and SCAFFOLD diverged (issue 15).

Task: the embedded digits as one digit (8) against the rest, subsampled to 15 % positives
(``DigitsFederated(binary_positive=8, positive_fraction=0.15)``, 1,177 scans).

* **HarmoFL** — 5 sites with the built-in styles, iid, 15 rounds, the BN CNN, SGD lr 0.05 momentum 0.9
  (``configs/fedavg_digits.yaml``), with amplitude normalisation (AN, v = 0.1) and/or weight perturbation
  (WP, radius α). Measured inside every WP step (a probe callback placed before WP): ‖δ‖/‖w‖ (global, and the
  largest per-tensor ratio), the loss at w + δ over the loss at w on the first batch of each fit, the cosine
  between g = ∇ℓ(w) and the perturbed g' = ∇ℓ(w + δ) and ‖g'‖/‖g‖, the relative change of the BatchNorm
  layers' batch variances between the two passes; and, for every run, the global model's mean logit margin
  z₁ − z₀ on positives and on negatives (first batch of each site, last round).
* **SCAFFOLD** — 10 sites, Dirichlet(0.1) label split, no styles, 20 rounds, plain SGD lr 0.05
  (``configs/fedavg_digits_dirichlet.yaml``), seeds 0 and 1, with the three control-variate weightings of
  ``callbacks.Scaffold`` (``uniform`` is the paper's update and was the only one before). Measured on the server:
  ‖c‖ after every round, and per client in round 1 its samples n_i, steps τ_i, classes and
  ‖(w − w_i)/(τ_i η)‖.

Both are also run on the 10-class task of the shipped configs, to check that the chosen defaults still train there.
Every run goes through ``fl_lightning.cli.main``; the whole script takes about 8 minutes on one core.

    python experiments/degenerate.py [--out experiments/results/degenerate]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fl_lightning.callback import FederatedCallback  # noqa: E402
from fl_lightning.cli import main  # noqa: E402
from fl_lightning.ops.sharpness import perturb, restore  # noqa: E402

# The probes are given to the CLI by class path; this name makes them the objects of this very module.
sys.modules.setdefault("degenerate_probes", sys.modules[__name__])
LOG: dict[str, list[Any]] = defaultdict(list)

BINARY = ["--data.init_args.binary_positive=8", "--data.init_args.positive_fraction=0.15"]
AN = {"class_path": "callbacks.AmplitudeNormalization", "init_args": {"v": 0.1, "band": 1.0}}


def wp(alpha: float) -> dict[str, Any]:
    return {"class_path": "callbacks.WeightPerturbation", "init_args": {"alpha": alpha}}


def probe(alpha: float | None) -> dict[str, Any]:
    return {"class_path": "degenerate_probes.PerturbationProbe", "init_args": {"alpha": alpha}}


def scaffold(weights: str) -> dict[str, Any]:
    return {"class_path": "callbacks.Scaffold", "init_args": {"control_weights": weights}}


SCAFFOLD_PROBE = {"class_path": "degenerate_probes.ScaffoldProbe"}


# ------------------------------------------------------------------------------------------------ probes
class PerturbationProbe(L.Callback):
    """Measures WP's step from the outside (placed before ``WeightPerturbation``); margins in every run."""

    def __init__(self, alpha: float | None = None) -> None:
        self.alpha = alpha
        self._bn: list[torch.Tensor] = []
        self._hooks: list[Any] = []
        self._batch: Any = None
        self._first = False
        self._g: list[torch.Tensor | None] = []
        self._bn_first: list[torch.Tensor] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def hook(mod: torch.nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if mod.training:
                self._bn.append(inp[0].detach().var((0, 2, 3)))

        self._hooks = [
            m.register_forward_hook(hook) for m in pl_module.modules() if isinstance(m, torch.nn.BatchNorm2d)
        ]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for h in self._hooks:
            h.remove()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._bn, self._batch, self._first = [], batch, idx == 0
        if idx == 0:  # the global model of this round (before any local step), in eval mode
            x, y = batch
            pl_module.eval()
            with torch.no_grad():
                z = pl_module(x)
            pl_module.train()
            if z.shape[1] == 2:
                d = z[:, 1] - z[:, 0]
                LOG["margins"].append(
                    (float(d[y == 1].mean()) if (y == 1).any() else math.nan, float(d[y == 0].mean()))
                )

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.alpha is None:
            return
        self._bn_first = list(self._bn)  # BatchNorm inputs of Lightning's pass (at w)
        params = [p for p in pl_module.parameters() if p.requires_grad]
        self._g = [None if p.grad is None else p.grad.detach().clone() for p in params]
        grads = [g for g in self._g if g is not None]
        gnorm = torch.sqrt(sum((g**2).sum() for g in grads))
        wnorm = torch.sqrt(sum((p.detach() ** 2).sum() for p in params))
        LOG["delta_w"].append(float(self.alpha / wnorm))
        LOG["delta_w_tensor"].append(
            max(
                float(self.alpha * g.norm() / gnorm / p.detach().norm())
                for p, g in zip(params, self._g, strict=True)
                if g is not None and p.detach().norm() > 1e-3  # zero-initialised biases have no scale yet
            )
        )
        if self._first:  # L(w + δ) / L(w) on this batch, with WP's own perturbation, everything restored
            x, y = self._batch
            buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
            norm = getattr(pl_module, "input_norm", None)
            if norm is not None:
                norm.eval()
            with torch.no_grad():
                before = F.cross_entropy(pl_module(x), y)
                saved = perturb(params, self.alpha)
                after = F.cross_entropy(pl_module(x), y)
                restore(saved)
            if norm is not None:
                norm.train()
            restore(buffers)
            LOG["loss_ratio"].append(float(after / before))
        self._bn = []  # from here the hooks see WP's perturbed pass (at w + δ) only

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.alpha is None:
            return
        params = [p for p in pl_module.parameters() if p.requires_grad]
        pairs = [(g, p.grad) for g, p in zip(self._g, params, strict=True) if g is not None and p.grad is not None]
        dot = sum((a * b).sum() for a, b in pairs)
        n1 = torch.sqrt(sum((a**2).sum() for a, _ in pairs))
        n2 = torch.sqrt(sum((b**2).sum() for _, b in pairs))
        LOG["cos"].append(float(dot / (n1 * n2)))
        LOG["grad_ratio"].append(float(n2 / n1))
        LOG["bn_var"].append((self._bn_first, list(self._bn)))


class ScaffoldProbe(FederatedCallback):
    """Server side: ‖c‖ after every round; per client in round 1: n_i, τ_i, classes, ‖(w − w_i)/(τ_i η)‖."""

    def on_reply(self, server: Any, task: Any, reply: Any, weight: float) -> None:
        if task.round != 0 or task.state is None or reply.state is None:
            return
        lr = float(server.module.hparams.get("lr", 0.05))
        keys = [k for k in task.state if task.state[k].is_floating_point() and k in reply.state]
        sq = sum(((task.state[k] - reply.state[k]).double() ** 2).sum() for k in keys if "running" not in k)
        counts = server.data.label_counts(task.client_id)
        LOG["clients"].append(
            {
                "client": task.client_id,
                "n": int(reply.num_samples),
                "steps": int(reply.num_steps),
                "classes": int((counts > 0).sum()),
                "mean_step": float(torch.sqrt(sq)) / (reply.num_steps * lr),
            }
        )

    def on_round_end(self, server: Any, round_idx: int, row: dict[str, Any]) -> None:
        for cb in server.callbacks:
            c = getattr(cb, "c", None)
            if isinstance(c, dict) and c:
                LOG["c_norm"].append(float(torch.sqrt(sum((v.double() ** 2).sum() for v in c.values()))))


# ------------------------------------------------------------------------------------------------ runs
def run(config: str, extra: list[str], callbacks: list[dict[str, Any]] | None, out: Path) -> dict[str, Any]:
    """One run through the CLI; returns its pooled metrics, per-round train losses and what the probes logged."""
    LOG.clear()
    args = [
        "--config",
        str(ROOT / "configs" / config),
        "--trainer.logger=false",
        "--federation.quiet=true",
        "--federation.plots=false",
        "--federation.checkpoint_every=0",
        f"--federation.output_dir={out}",
        *extra,
    ]
    if callbacks is not None:
        args.append("--trainer.callbacks=" + json.dumps(callbacks))
    t0 = time.perf_counter()
    failed = None
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stderr(io.StringIO()),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        try:
            summary = main(args)
        except RuntimeError as err:  # every client failed (non-finite weights)
            failed, summary = str(err).split(":")[0], None
    run_dir = Path(summary["run_dir"]) if summary else max(out.glob("*"), key=lambda p: p.stat().st_mtime)
    losses: dict[int, list[tuple[float, int]]] = defaultdict(list)
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row["train_loss"]:
                losses[int(row["round"])].append((float(row["train_loss"]), int(row["train_samples"])))
    train_loss = [sum(v * n for v, n in losses[r]) / sum(n for _, n in losses[r]) for r in sorted(losses)]
    res: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1), "train_loss": train_loss, "failed": failed}
    if summary:
        res["pooled"] = {k: summary["pooled"][k] for k in ("acc", "balanced_acc", "auroc")}
        res["collapse"] = summary["collapse"]["detected"]
    res.update(_probe_summary())
    return res


def _probe_summary() -> dict[str, Any]:
    out: dict[str, Any] = {}
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    if LOG["delta_w"]:
        out["delta_over_w"] = mean(LOG["delta_w"])
        out["delta_over_w_tensor_max"] = max(LOG["delta_w_tensor"])
        ratios = LOG["loss_ratio"]
        out["loss_ratio_round1"] = mean(ratios[: len(ratios) // 15 or 1])
        out["loss_ratio_last"] = mean(ratios[-(len(ratios) // 15 or 1) :])
        out["cos_g_gp"] = mean(LOG["cos"])
        out["grad_ratio"] = mean(LOG["grad_ratio"])
        # Per BatchNorm layer: batch variances of the perturbed pass against those of the first pass.
        shifts = [
            float(((b - a).abs() / (a + 1e-5)).mean())
            for first, perturbed in LOG["bn_var"]
            for a, b in zip(first, perturbed, strict=True)
        ]
        out["bn_var_shift"] = mean(shifts)
    if LOG["margins"]:
        last = LOG["margins"][-5:]
        out["margin_pos"] = mean([m[0] for m in last if not math.isnan(m[0])])
        out["margin_neg"] = mean([m[1] for m in last])
    if LOG["c_norm"]:
        out["c_norm"] = list(LOG["c_norm"])
    if LOG["clients"]:
        out["clients_round1"] = list(LOG["clients"])
    return out


HARMOFL_RUNS: list[tuple[str, list[str], list[dict[str, Any]], float | None]] = [
    # name, extra arguments, method callbacks, WP radius (for the probe)
    ("FedAvg", [], [], None),
    ("AN only", [], [AN], None),
    ("WP α=0 (two passes, no radius)", [], [wp(0.0)], 0.0),
    ("WP α=0.05", [], [wp(0.05)], 0.05),
    ("WP α=0.05, momentum 0", ["--model.init_args.momentum=0"], [wp(0.05)], 0.05),
    ("FedAvg, momentum 0", ["--model.init_args.momentum=0"], [], None),
    ("WP α=0.01", [], [wp(0.01)], 0.01),
    ("HarmoFL α=0.05 (old default)", [], [AN, wp(0.05)], 0.05),
    ("HarmoFL α=0.01 (new default)", [], [AN, wp(0.01)], 0.01),
    ("HarmoFL α=0.05, seed 1", ["--seed_everything=1", "--data.init_args.seed=1"], [AN, wp(0.05)], 0.05),
    ("HarmoFL α=0.01, seed 1", ["--seed_everything=1", "--data.init_args.seed=1"], [AN, wp(0.01)], 0.01),
]
TEN_CLASS_HARMOFL = [
    ("10-class FedAvg", [], [], None),
    ("10-class HarmoFL α=0.05", [], [AN, wp(0.05)], 0.05),
    ("10-class HarmoFL α=0.01", [], [AN, wp(0.01)], 0.01),
]
DIRICHLET = ["--data.init_args.alpha=0.1"]
SCAFFOLD_RUNS: list[tuple[str, list[str], list[dict[str, Any]]]] = [
    ("FedAvg", [], []),
    ("SCAFFOLD uniform c (old)", [], [scaffold("uniform")]),
    ("SCAFFOLD uniform c, uniform aggregation", ["--federation.aggregation=uniform"], [scaffold("uniform")]),
    ("SCAFFOLD c weighted p_i", [], [scaffold("aggregation")]),
    ("SCAFFOLD c weighted p_i·τ_i (new default)", [], [scaffold("steps")]),
]


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, spec)


def _metrics(res: dict[str, Any]) -> str:
    if res.get("failed"):
        return f"{'failed: ' + res['failed']:<29}"
    p = res["pooled"]
    flag = " collapse" if res["collapse"] else ""
    return f"{_fmt(p['acc'])} {_fmt(p['balanced_acc'])} {_fmt(p['auroc'])}{flag:<9}"


def main_cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "degenerate")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"harmofl": {}, "scaffold": {}}
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        emit("HarmoFL — digit 8 vs rest (15 % positives), 5 styled sites, iid, 15 rounds, SGD lr 0.05 momentum 0.9")
        emit(
            f"{'run':<34} {'acc':>5} {'bacc':>5} {'auroc':>5} {'':8} {'loss r1':>7} {'loss r15':>8} "
            f"{'‖δ‖/‖w‖':>7} {'max_k':>6} {'L(w+δ)/L(w) r1/r15':>18} {'cos(g,g′)':>9} {'‖g′‖/‖g‖':>8} "
            f"{'BN var Δ':>8} {'margin +/−':>12}"
        )
        for name, extra, cbs, alpha in HARMOFL_RUNS + TEN_CLASS_HARMOFL:
            binary = not name.startswith("10-class")
            res = run("fedavg_digits.yaml", (BINARY if binary else []) + extra, [probe(alpha), *cbs], Path(tmp) / "h")
            results["harmofl"][name] = res
            ratio = f"{_fmt(res.get('loss_ratio_round1'), '.2f')}/{_fmt(res.get('loss_ratio_last'), '.2f')}"
            margin = f"{_fmt(res.get('margin_pos'), '+.1f')}/{_fmt(res.get('margin_neg'), '+.1f')}" if binary else ""
            emit(
                f"{name:<34} {_metrics(res)} {_fmt(res['train_loss'][0]):>7} {_fmt(res['train_loss'][-1]):>8} "
                f"{_fmt(res.get('delta_over_w'), '.4f'):>7} {_fmt(res.get('delta_over_w_tensor_max'), '.3f'):>6} "
                f"{ratio:>18} {_fmt(res.get('cos_g_gp')):>9} {_fmt(res.get('grad_ratio'), '.2f'):>8} "
                f"{_fmt(res.get('bn_var_shift'), '.4f'):>8} {margin:>12}"
            )
        emit()
        emit("SCAFFOLD — digit 8 vs rest (15 % positives), 10 sites, Dirichlet(0.1), 20 rounds, SGD lr 0.05")
        emit(
            f"{'run':<42} {'seed':>4} {'acc':>5} {'bacc':>5} {'auroc':>5} {'':8} {'loss r1':>7} "
            f"{'max loss':>9} {'‖c‖ r1':>7} {'max ‖c‖':>9} {'‖c‖ last':>9}"
        )
        for seed in (0, 1):
            for name, extra, cbs in SCAFFOLD_RUNS:
                seeded = [f"--seed_everything={seed}", f"--data.init_args.seed={seed}"]
                res = run(
                    "fedavg_digits_dirichlet.yaml",
                    BINARY + DIRICHLET + seeded + extra,
                    [*cbs, SCAFFOLD_PROBE],
                    Path(tmp) / "s",
                )
                results["scaffold"][f"{name}, seed {seed}"] = res
                c = res.get("c_norm") or [math.nan]
                emit(
                    f"{name:<42} {seed:>4} {_metrics(res)} {_fmt(res['train_loss'][0]):>7} "
                    f"{_fmt(max(res['train_loss']), '.3g'):>9} {_fmt(c[0], '.3g'):>7} {_fmt(max(c), '.3g'):>9} "
                    f"{_fmt(c[-1], '.3g'):>9}"
                )
        emit()
        emit("SCAFFOLD round 1, per client (seed 0): samples n_i, local steps τ_i, classes, ‖(w − w_i)/(τ_i η)‖")
        for row in results["scaffold"]["SCAFFOLD uniform c (old), seed 0"].get("clients_round1", []):
            head = f"  {row['client']:<7} n={row['n']:>4} τ={row['steps']:>3} classes={row['classes']}"
            emit(f"{head} ‖(w − w_i)/(τ_i η)‖={row['mean_step']:.2f}")
        emit()
        emit("10-class check: configs/scaffold_digits_dirichlet.yaml (Dirichlet 0.5, 10 sites, 20 rounds)")
        for name, cbs in (
            ("FedAvg", []),
            ("SCAFFOLD uniform c (old)", [scaffold("uniform")]),
            ("SCAFFOLD p_i·τ_i (new default)", [scaffold("steps")]),
        ):
            res = run("fedavg_digits_dirichlet.yaml", [], [*cbs, SCAFFOLD_PROBE], Path(tmp) / "t")
            results["scaffold"][f"10-class {name}"] = res
            emit(
                f"{name:<42} {'0':>4} {_metrics(res)} {_fmt(res['train_loss'][0]):>7} {_fmt(res['train_loss'][-1]):>9}"
            )
    emit()
    emit(f"total {time.perf_counter() - t_start:.0f} s")
    (args.out / "degenerate.txt").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main_cli()
