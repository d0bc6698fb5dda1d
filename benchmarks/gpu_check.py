"""One short validation run of the library on a GPU machine: correctness, device placement, speed (< 6 min).

Eight checks, each isolated (a failure prints its traceback, is recorded as FAIL and the next check runs):
environment; FedAvg in 32-true / bf16-mixed vs CPU; HarmoFL in bf16-mixed / 32-true; SCAFFOLD, FedProx, FedBN,
MOON, FedNova, FedOpt with the devices of their callback and checkpoint tensors; DDI + sample-clustered FL
(``configs/scfl_digits_seg.yaml``, shortened); resume vs an uninterrupted run; ``benchmarks/per_sample_grads.py``
and ``benchmarks/overhead.py``; the fixed cost of one client ``trainer.fit``. Observations that are not errors
(tensors left on the GPU, a bf16 kernel missing, a speed target missed) are listed as findings. The report is
printed and written as JSON to ``$OUT/gpu_check.json`` (``./gpu_check.json`` without ``OUT``), after every check.

    python benchmarks/gpu_check.py --device cuda
    python benchmarks/gpu_check.py --device cpu --quick    # dry run with tiny sizes (< 3 min on 2 cores)
"""

# ruff: noqa: E402 (the imports of the repository follow the sys.path set-up)
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import json
import logging
import os
import platform
import re
import runpy
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # lets the resume check run cuBLAS deterministically
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository need not be pip-installed on the GPU machine

import lightning as L
import torch
import torch.nn.functional as F
import yaml

from callbacks import AmplitudeNormalization, FedBN, FedNova, FedOpt, FedProx, Moon, Scaffold, WeightPerturbation
from datamodules import DigitsFederated, DigitsSegFederated
from fl_lightning import ClassificationClient, Federation, FederationConfig, local_federation
from fl_lightning.cli import TRAINER_DEFAULTS  # Lightning skips jsonargparse when absent
from fl_lightning.clients import SegmentationClient
from fl_lightning.ops.state import all_finite
from fl_lightning.runtime.local_fit import LocalFitter

logging.getLogger("lightning").setLevel(logging.WARNING)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
Result = dict[str, Any]


def walk(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts/lists/tuples, with its path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk(v, f"{path}/{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from walk(v, f"{path}/{i}")


def kinds(obj: Any) -> dict[str, int]:
    """How many tensors of each device/dtype ``obj`` holds, e.g. ``{"cpu/float32": 12}``."""
    out: dict[str, int] = {}
    for _, t in walk(obj):
        key = f"{t.device.type}/{str(t.dtype).removeprefix('torch.')}"
        out[key] = out.get(key, 0) + 1
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_trainer(device: str, precision: str = "32-true", callbacks: list[L.Callback] | None = None) -> L.Trainer:
    accelerator = "gpu" if device.startswith("cuda") else "cpu"
    extra = {"logger": False, "accelerator": accelerator, "precision": precision, "callbacks": callbacks or []}
    return L.Trainer(**{**TRAINER_DEFAULTS, **extra})


def digits(args: argparse.Namespace, momentum: float = 0.9) -> tuple[DigitsFederated, ClassificationClient]:
    """5 styled digit sites at 16 px and a seeded SmallCNN client trained with SGD (lr 0.05)."""
    data = DigitsFederated(num_clients=5, image_size=16, seed=0)
    L.seed_everything(0, verbose=False)
    size, width = data.image_size, 16 if args.quick else 32
    return data, ClassificationClient(num_classes=10, image_size=size, width=width, lr=0.05, momentum=momentum)


def federate(model: Any, data: Any, trainer: L.Trainer, rounds: int, out: str, **cfg: Any) -> tuple[Federation, Result]:
    """One Federation run; client failures (warnings) are counted, and quoted when the whole run fails."""
    config = FederationConfig(rounds=rounds, output_dir=out, progress=False, plots=False, **cfg)
    fed = local_federation(config, model, data, trainer, seed=0)
    with warnings.catch_warnings(record=True) as caught:  # the library's own filters still drop its known noise
        try:
            summary = fed.run()
        except Exception as err:
            fails = [str(w.message) for w in caught if "left out" in str(w.message)]
            raise RuntimeError(f"{fails[0] if fails else 'no client failure'}; then: {err}") from err
    summary["failed_clients"] = sum("left out" in str(w.message) for w in caught)
    summary["warnings"] = sorted({str(w.message)[:160] for w in caught})[:8]  # e.g. non-deterministic kernels
    return fed, summary


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double().cpu() - b[k].double().cpu()).abs().max().item() for k in a)


def fedavg_run(args: argparse.Namespace, out: str, device: str, precision: str) -> tuple[Result, Any]:
    data, model = digits(args)
    start = time.perf_counter()
    fed, summary = federate(model, data, make_trainer(device, precision), 3, out)
    state, seconds = fed.groups[0].state, round(time.perf_counter() - start, 1)
    res = {"acc": summary["pooled"]["acc"], "finite": all_finite(state), "failed_clients": summary["failed_clients"]}
    module_device = str(next(fed.module.parameters()).device)  # where Lightning's teardown left the client module
    res.update(state=kinds(state), module_device=module_device, seconds=seconds, warnings=summary["warnings"])
    return res, state


# ---------------------------------------------------------------------------------------------- checks
def check_environment(args: argparse.Namespace, out: str) -> Result:
    res: Result = {"python": platform.python_version(), "torch": torch.__version__, "lightning": L.__version__}
    res.update(torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(), threads=torch.get_num_threads())
    res.update({f"{m}_imported": m in sys.modules for m in ("jsonargparse", "wandb")})
    if args.device.startswith("cuda"):
        start = time.perf_counter()
        torch.zeros(1, device=args.device)
        props = torch.cuda.get_device_properties(args.device)
        res.update(cuda_init_s=round(time.perf_counter() - start, 1), gpu=props.name)
        res.update(bf16=torch.cuda.is_bf16_supported(), cudnn=torch.backends.cudnn.version())
        res.update(capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1))
        res.update(matmul_precision=torch.get_float32_matmul_precision())
    res["headline"] = (
        f"torch {torch.__version__} lightning {L.__version__} {res.get('gpu', 'cpu')} bf16 {res.get('bf16')}"
    )
    return res


def check_fedavg(args: argparse.Namespace, out: str) -> Result:
    res, states, dev = {}, {}, args.device
    runs = (("device_32", dev, "32-true"), ("device_bf16", dev, "bf16-mixed"), ("cpu_32", "cpu", "32-true"))
    for key, device, precision in runs:
        res[key], states[key] = fedavg_run(args, out, device, precision)
    res["max_dw_device_vs_cpu_32"] = max_diff(states["device_32"], states["cpu_32"])
    res["max_dw_bf16_vs_32"] = max_diff(states["device_bf16"], states["device_32"])
    res["gap_device_vs_cpu_32"] = abs(res["device_32"]["acc"] - res["cpu_32"]["acc"])
    res["gap_bf16_vs_32"] = abs(res["device_bf16"]["acc"] - res["device_32"]["acc"])
    assert all(res[k]["finite"] and not res[k]["failed_clients"] for k in states), "non-finite or failed clients"
    odd = [k for k in ("device_32", "device_bf16") if set(res[k]["state"]) - {"cpu/float32", "cpu/int64"}]
    res["findings"] = [f"FedAvg {k}: group state tensors {res[k]['state']}" for k in odd]
    left = [k for k in states if res[k]["module_device"] != "cpu"]
    res["findings"] += [f"FedAvg {k}: client module left on {res[k]['module_device']} after the run" for k in left]
    res["headline"] = " ".join(f"{k} acc {res[k]['acc']:.3f};" for k in states)
    res["headline"] += f" max|dw| dev-cpu {res['max_dw_device_vs_cpu_32']:.1e} bf16-32 {res['max_dw_bf16_vs_32']:.1e}"
    return res


def check_harmofl(args: argparse.Namespace, out: str) -> Result:
    res: Result = {"findings": []}
    for precision in ("bf16-mixed", "32-true"):
        data, model = digits(args)
        cbs: list[L.Callback] = [AmplitudeNormalization(v=0.1, band=1.0), WeightPerturbation(alpha=0.05)]
        try:
            fed, summary = federate(model, data, make_trainer(args.device, precision, cbs), 2, out)
            res[precision] = {"acc": summary["pooled"]["acc"], "finite": all_finite(fed.groups[0].state)}
            res[precision]["failed_clients"] = summary["failed_clients"]
        except Exception as err:  # noqa: BLE001 - recorded: learning whether it fails is the point
            traceback.print_exc()
            res[precision] = {"error": f"{type(err).__name__}: {err}"[:800]}
            res["findings"].append(f"HarmoFL {precision} on {args.device} fails: {str(err)[:300]}")
    ok = res["32-true"]
    assert "error" not in ok and ok["finite"] and not ok["failed_clients"], f"HarmoFL 32-true: {ok}"
    res["headline"] = "; ".join(
        f"{p} acc {r['acc']:.3f}" if "acc" in r else f"{p} ERROR" for p, r in res.items() if p != "findings"
    )
    return res


def check_methods(args: argparse.Namespace, out: str) -> Result:
    methods: dict[str, tuple[Callable[[], L.Callback], float]] = {  # name: (callback, SGD momentum)
        "SCAFFOLD": (Scaffold, 0.0), "FedProx": (lambda: FedProx(mu=0.01), 0.9), "FedBN": (FedBN, 0.9),
        "MOON": (lambda: Moon(mu=1.0), 0.9), "FedNova": (FedNova, 0.9), "FedOpt": (lambda: FedOpt("adam"), 0.9),
    }  # fmt: skip
    res: Result = {"findings": []}
    for name, (make_cb, momentum) in methods.items():
        try:
            data, model = digits(args, momentum)
            trainer = make_trainer(args.device, "32-true", [make_cb()])
            fed, summary = federate(model, data, trainer, 2, out, checkpoint_every=1, run_name=name)
            ckpt = sorted((fed.run_dir.path / "checkpoints").glob("round-*.ckpt"))[-1]
            state = torch.load(ckpt, weights_only=True, map_location=None)
            off_cpu = [p for p, t in walk(state) if t.device.type != "cpu"]
            r = {"acc": summary["pooled"]["acc"], "finite": all_finite(fed.groups[0].state)}
            r.update(failed_clients=summary["failed_clients"], checkpoint_tensors=kinds(state))
            r.update(callback_state={type(cb).__name__: kinds(cb.state_dict()) for cb in fed.callbacks})
            r.update(n_off_cpu=len(off_cpu), checkpoint_off_cpu=off_cpu[:8], warnings=summary["warnings"])
            if off_cpu:
                res["findings"].append(f"{name}: checkpoint holds {len(off_cpu)} non-CPU tensors, e.g. {off_cpu[:3]}")
            if not r["finite"] or r["failed_clients"]:
                r["error"] = "non-finite weights or failed clients"
        except Exception as err:  # noqa: BLE001 - the other methods still run
            traceback.print_exc()
            r = {"error": f"{type(err).__name__}: {err}"[:800]}
        res[name] = r
    failed = [n for n in methods if "error" in res[n]]
    assert not failed, f"methods failed: {failed}"
    res["headline"] = " ".join(f"{n} {res[n]['acc']:.2f}/{res[n]['n_off_cpu']}" for n in methods) + " (acc/#gpu ckpt)"
    return res


def check_ddi(args: argparse.Namespace, out: str) -> Result:
    cfg = yaml.safe_load((ROOT / "configs" / "scfl_digits_seg.yaml").read_text())
    data_args, model_args = dict(cfg["data"]["init_args"]), dict(cfg["model"]["init_args"])
    rounds, split, selector_rounds = 6, 3, 5
    if args.quick:
        data_args.update(num_clients=4, num_samples=200, image_size=16)
        model_args["width"] = 8
        rounds, split, selector_rounds = 3, 2, 2
    L.seed_everything(cfg["seed_everything"], verbose=False)
    data = DigitsSegFederated(**data_args)
    model = SegmentationClient(num_classes=data.num_classes, in_channels=1, image_size=data.image_size, **model_args)
    cbs = []
    for spec in cfg["trainer"]["callbacks"]:
        module, name = spec["class_path"].rsplit(".", 1)
        kwargs = dict(spec.get("init_args", {}))
        if name == "DomainIsolation":
            kwargs.update(split_round=split, selector_rounds=selector_rounds, plots=False)
        cbs.append(getattr(importlib.import_module(module), name)(**kwargs))
    fed_args = {k: v for k, v in cfg["federation"].items() if k not in ("rounds", "output_dir", "eval_every")}
    start = time.perf_counter()
    trainer = make_trainer(args.device, "32-true", cbs)
    _, summary = federate(model, data, trainer, rounds, out, eval_every=0, checkpoint_every=0, **fed_args)
    res: Result = {"seconds": round(time.perf_counter() - start, 1), "rounds": rounds, "split_round": split}
    res.update(domain_isolation=summary["domain_isolation"], failed_clients=summary["failed_clients"])
    for model_name in ("global", "selector", "oracle"):
        res[f"{model_name}_dice"] = summary["summary"].get(model_name, {}).get("dice", {}).get("mean")
    assert summary["domain_isolation"]["split"], "DDI did not split"
    ri, nan = summary["domain_isolation"].get("rand_index", float("nan")), float("nan")
    sel, ora = res["selector_dice"] or nan, res["oracle_dice"] or nan
    res["headline"] = f"RI {ri:.3f}, Dice selector {sel:.3f} oracle {ora:.3f} global {res['global_dice']:.3f}"
    return res


def check_resume(args: argparse.Namespace, out: str) -> Result:
    cudnn = torch.backends.cudnn
    flags = (cudnn.deterministic, cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    cudnn.deterministic, cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs, accs, caught = {}, {}, set()
        for name, rounds, resume in (("full", 4, None), ("part", 2, None), ("resumed", 4, "part")):
            data, model = digits(args)
            resume_dir = str(Path(out) / f"resume-{resume}") if resume else None
            cfg = {"checkpoint_every": 1, "run_name": f"resume-{name}", "resume": resume_dir}
            fed, summary = federate(model, data, make_trainer(args.device), rounds, out, **cfg)
            runs[name], accs[name] = fed.groups[0].state, summary["pooled"]["acc"]
            caught.update(summary["warnings"])
    finally:
        cudnn.deterministic, cudnn.benchmark = flags[:2]
        torch.use_deterministic_algorithms(flags[2])
    diff = max_diff(runs["full"], runs["resumed"])
    res: Result = {"max_abs_weight_diff": diff, "acc_full": accs["full"], "acc_resumed": accs["resumed"]}
    res["warnings"] = sorted(caught)
    res["findings"] = [f"resumed run differs from the uninterrupted one: max |dw| {diff:.2e}"] if diff else []
    res["headline"] = f"max |dw| resumed vs uninterrupted {diff:.2e}; acc {accs['full']:.3f} / {accs['resumed']:.3f}"
    return res


def run_script(name: str, argv: list[str]) -> tuple[str, str | None]:
    """Run ``benchmarks/<name>`` in this process (no second CUDA start-up): what it printed, and its error if any."""
    old_argv, threads, buf, error = sys.argv, torch.get_num_threads(), io.StringIO(), None
    sys.argv = [name, *argv]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(str(ROOT / "benchmarks" / name), run_name="__main__")
    except (Exception, SystemExit):  # noqa: BLE001 - reported by the caller
        error = traceback.format_exc()[-1500:]
    finally:
        sys.argv = old_argv
        torch.set_num_threads(threads)
    print(buf.getvalue(), error or "", sep="", end="")
    return buf.getvalue(), error


def check_speed(args: argparse.Namespace, out: str) -> Result:
    scripts = {  # name: (the printed ratio, arguments with --quick, arguments on the GPU)
        "per_sample_grads.py": (r"speed-up loop/vmap: ([\d.]+)x", ["--batch", "8", "--repeats", "1"],
                                ["--repeats", "3"]),
        "overhead.py": (r"ratio \(best of \d+\)\s*:\s*([\d.]+)", ["--rounds", "1", "--repeats", "1", "--width", "8"],
                        ["--rounds", "5", "--repeats", "2"]),
    }  # fmt: skip
    res: Result = {"findings": []}
    for name, (pattern, quick, full) in scripts.items():
        argv = ["--device", args.device, *(quick if args.quick else full)]
        text, error = run_script(name, argv)
        if error and name == "per_sample_grads.py" and "AssertionError" in error and torch.backends.cudnn.allow_tf32:
            res["findings"].append(f"{name}: vmap and loop gradients disagree with TF32 convolutions; rerun without")
            torch.backends.cudnn.allow_tf32 = False
            try:
                text, error = run_script(name, argv)
            finally:
                torch.backends.cudnn.allow_tf32 = True
        match = re.search(pattern, text)
        res[name] = {"ratio": float(match.group(1)) if match else None, "output": text, "error": error}
    vmap, overhead = res["per_sample_grads.py"]["ratio"], res["overhead.py"]["ratio"]
    if vmap is not None and vmap < 5.0:
        res["findings"].append(f"per-sample gradients: vmap only {vmap:.2f}x faster than the Python loop (target 5x)")
    assert vmap is not None and overhead is not None, "a benchmark script failed (see its error)"
    res["headline"] = f"vmap {vmap:.2f}x loop (target >= 5); federation/plain {overhead:.2f}"
    return res


def check_fit_cost(args: argparse.Namespace, out: str) -> Result:
    n, dev = (10 if args.quick else 50), args.device
    data, module = digits(args)
    cid = data.client_ids[0]
    loader = data.client_train_loader(cid, steps=1)
    fitter = LocalFitter(make_trainer(dev))
    net = copy.deepcopy(module.net).to(dev)
    start = time.perf_counter()
    fitter.fit(module, loader, 1, cid)  # warm-up: the first fit also sets the Trainer up
    sync(dev)
    first_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    for _ in range(n):
        fitter.fit(module, loader, 1, cid)
    sync(dev)
    fit_ms = (time.perf_counter() - start) / n * 1e3
    x, y = next(iter(loader))
    times = []
    for _ in range(n + 1):  # the first is a warm-up
        start = time.perf_counter()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        opt.zero_grad()
        F.cross_entropy(net(x.to(dev)), y.to(dev)).backward()
        opt.step()
        sync(dev)
        times.append(time.perf_counter() - start)
    step_ms = min(times[1:]) * 1e3
    res = {"fits": n, "first_fit_ms": first_ms, "ms_per_fit": fit_ms, "ms_per_plain_step": step_ms}
    return {**res, "headline": f"{fit_ms:.1f} ms per 1-batch fit vs {step_ms:.2f} ms plain step (incl. new optimiser)"}


CHECKS: dict[str, Callable[[argparse.Namespace, str], Result]] = {
    "1 environment": check_environment, "2 fedavg precision": check_fedavg, "3 harmofl": check_harmofl,
    "4 methods+checkpoints": check_methods, "5 ddi scfl": check_ddi, "6 resume": check_resume,
    "7 speed": check_speed, "8 fit cost": check_fit_cost,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU dry run)")
    parser.add_argument("--only", nargs="+", type=int, help="run only these check numbers")
    parser.add_argument("--time-limit", type=float, default=330.0, help="skip checks that would start later (s)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 with --quick)")
    args = parser.parse_args()
    if args.threads or args.quick:
        torch.set_num_threads(args.threads or 1)  # 2 threads on a busy 2-core machine are ~100x slower than 1
    path = Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report: Result = {"args": vars(args), "checks": {}, "findings": []}
    t0 = time.perf_counter()
    for name, fn in CHECKS.items():
        if args.only and int(name.split()[0]) not in args.only:
            continue
        if time.perf_counter() - t0 > args.time_limit:
            report["checks"][name] = {"status": "SKIPPED", "headline": "time limit reached"}
            continue
        print(f"\n===== check {name} =====", flush=True)
        start = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as out:
                res = {"status": "PASS", **fn(args, out)}
        except Exception as err:  # noqa: BLE001 - one failure must not hide the other checks
            traceback.print_exc()
            res = {"status": "FAIL", "error": traceback.format_exc()[-2000:], "headline": repr(err)[:200]}
        res["seconds"] = round(time.perf_counter() - start, 1)
        report["findings"] += [f"[{name}] {f}" for f in res.get("findings", [])]
        report["checks"][name] = res
        report["total_seconds"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"----- {name}: {res['status']} ({res['seconds']} s) {res.get('headline', '')}", flush=True)
    print(f"\n{'check':24s} {'status':7s} {'s':>6s}  numbers")
    for name, res in report["checks"].items():
        print(f"{name:24s} {res['status']:7s} {res.get('seconds', 0):6.1f}  {res.get('headline', '')}")
    print("findings:" if report["findings"] else "findings: none", *report["findings"], sep="\n  ")
    print(f"total {time.perf_counter() - t0:.0f} s; report written to {path}")


if __name__ == "__main__":
    main()
