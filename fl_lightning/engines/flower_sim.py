"""Our Flower apps on Flower's Simulation Engine (Ray backend), driven from one process.

``python -m fl_lightning.engines.flower_sim --num-supernodes 10 --client-cpus 1 --config configs/fedavg_digits.yaml
--federation.rounds=5`` runs the YAML (and the overrides after it) through our ServerApp and ClientApp with
``flwr.simulation.run_simulation`` (``pip install -e ".[flower-sim]"``): the ServerApp runs in a thread of this
process and writes the usual run directory; ``num-supernodes`` virtual SuperNodes share the data's clients by
``partition-id`` (node ``i`` of ``n`` hosts the clients at positions ``p % n == i``, see
:mod:`fl_lightning.engines.flower_site`), and Ray actors with ``client-cpus`` CPUs each answer their messages.

``run_simulation`` gives the apps an empty run config, so :func:`simulate` builds them with the run's own
(:func:`~fl_lightning.engines.flower.make_server_app`, :func:`~fl_lightning.engines.flower.make_client_app`);
``min-nodes`` is the number of SuperNodes, so the server describes all of them before the first round.
:func:`simulate` starts Ray itself, as Flower's backend would, while a thread imports the apps (torch, flwr) and
what the ServerApp builds with (Lightning): Ray's start-up mostly waits for its processes; each Ray actor starts
importing Lightning as its process starts (:func:`~fl_lightning.engines.flower_site.warm_up`). The virtual sites
keep their state in a fresh temporary directory (removed afterwards) unless ``state_dir`` is given: site states
of an earlier run with the same run name must not leak into this one, and resuming a simulation's checkpoint
needs the state directory it ran with.

What is not the Flower anchor's: every message is our protocol's blob (not Flower's ``ArrayRecord`` of the
model), evaluation happens on the sites (the server holds no data, as in a deployment), and each site saves
its state to disk after every message (an actor may answer another node's next message).
"""

from __future__ import annotations

import os

# No outbound traffic from a simulation: Flower's telemetry and update check and Ray's usage statistics are off
# unless the caller set them (Flower reads its variable when it is imported, so before the imports below).
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0"}
for _key, _value in QUIET_ENV.items():
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

# Ray runs this in every actor's process as it starts (a thread that imports Lightning; see flower_site.warm_up).
WARM_UP_HOOK = "fl_lightning.engines.flower_site.warm_up"


def simulate(
    args: list[str],
    num_supernodes: int,
    client_cpus: float = 1.0,
    client_gpus: float = 0.0,
    state_dir: str | Path | None = None,
    run_config: dict[str, Any] | None = None,
    ray_init_args: dict[str, Any] | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run a config on Flower's Simulation Engine; returns the run's summary (also in its ``summary.json``).

    Args:
        args: The run's command line as for ``train.py``: ``--config <yaml>`` first, then overrides. Relative
            ``--config`` paths are read from the working directory (the Ray actors share it).
        num_supernodes: Virtual SuperNodes; at most the data's number of clients (they share the clients).
        client_cpus: CPUs of each Ray actor (also its torch threads: Ray sets ``OMP_NUM_THREADS`` to it).
        client_gpus: GPUs (a fraction allowed) of each Ray actor.
        state_dir: Where the virtual sites keep their state (``partition-<i>/<run name>/``); default a fresh
            temporary directory, removed afterwards.
        run_config: Further run config entries (``timeout``, ``poll``, ... of
            :data:`~fl_lightning.engines.flower.RUN_DEFAULTS`).
        ray_init_args: ``ray.init`` arguments (e.g. ``{"num_cpus": 4}``); Flower's defaults otherwise, except
            that Ray gets no more CPUs than the SuperNodes' actors can use.
        verbose: Flower's debug logging.

    Raises:
        ValueError: If ``args`` does not start with ``--config``.
        RuntimeError: If the ServerApp ended without a summary.

    """
    # The server looks for replies every 10 ms, not 50: the engine's replies are in this process's memory, and
    # each round waits for two waves of them (fit, then evaluation on the sites).
    cfg = {**_run_config(args), "min-nodes": num_supernodes, "poll": 0.01, **(run_config or {})}
    summaries: list[dict[str, Any]] = []
    backend: dict[str, Any] = {"client_resources": {"num_cpus": client_cpus, "num_gpus": client_gpus}}
    init = dict(ray_init_args or {})
    if "num_cpus" not in init and num_supernodes * client_cpus < (os.cpu_count() or 1):
        # Flower starts as many actors as Ray's CPUs allow; more than one per SuperNode would only import torch
        init["num_cpus"] = math.ceil(num_supernodes * client_cpus)
    if init:
        backend["init_args"] = init
    # Ray's start-up leaves CPU idle (it waits for its processes): the apps (torch, flwr) and then the ServerApp's
    # Lightning are imported meanwhile in a thread, and once Ray is up the sites are asked to describe themselves
    # at once (see run_server). The driver itself imports nothing heavy before Ray starts, and Flower's simulation
    # only once the apps are in: two threads never import the same packages at the same time.
    apps_imported = threading.Event()
    importer = threading.Thread(target=_import_apps, args=(apps_imported,), name="fl-import-apps", daemon=True)
    importer.start()
    _start_ray(init, verbose)
    apps_imported.wait()
    from flwr.simulation import run_simulation  # needs Ray: the `flower-sim` extra

    from fl_lightning.engines.flower import make_client_app, make_server_app
    from fl_lightning.engines.flower_site import NODE_STATE_DIR

    try:
        with tempfile.TemporaryDirectory(prefix="fl-sim-state-") as scratch:
            node = {NODE_STATE_DIR: str(Path(state_dir or scratch).resolve())}
            run_simulation(
                server_app=make_server_app(cfg, on_summary=summaries.append),
                client_app=make_client_app(cfg, node_defaults=node),
                num_supernodes=num_supernodes,
                backend_config=backend,
                verbose_logging=verbose,
            )
    finally:
        import ray

        ray.shutdown()  # Flower's backend shuts Ray down when it ends; not when it failed to start
    if not summaries:
        raise RuntimeError("the ServerApp ended without a summary (see the log above)")
    return summaries[0]


def _import_apps(imported: threading.Event) -> None:
    """Import our Flower apps (torch, flwr), say so, then what the ServerApp builds with (Lightning)."""
    try:
        from fl_lightning.engines.flower import import_server
    finally:
        imported.set()  # on failure the driver's own import below raises the error
    import_server()


def _start_ray(init_args: dict[str, Any], verbose: bool) -> None:
    """Start Ray as Flower's Ray backend would (``run_simulation`` then finds it running and uses it).

    Flower's ``RayBackend.init_ray`` and ``run_simulation``'s defaults: no dashboard, Flower's logging level and
    actor logs to this process unless ``verbose``, and the actors get this process's ``sys.path``.
    """
    import ray
    from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG as DEFAULTS

    if ray.is_initialized():  # the caller's own Ray (Flower uses it as it is)
        return
    args: dict[str, Any] = {"include_dashboard": False, **init_args}
    if not verbose:
        args.setdefault("logging_level", DEFAULTS.init_args_logging_level)
        args.setdefault("log_to_driver", DEFAULTS.init_args_log_to_driver)
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    # Each actor starts importing Lightning as its process starts, not when its first message arrives.
    runtime_env = {"env_vars": {"PYTHONPATH": pythonpath}, "worker_process_setup_hook": WARM_UP_HOOK}
    ray.init(runtime_env=runtime_env, **args)


def _run_config(args: list[str]) -> dict[str, str]:
    """``--config <yaml> overrides...`` → the run config's ``config`` and ``overrides`` (config paths absolute)."""
    if not args or not (args[0] == "--config" or args[0].startswith("--config=")):
        raise ValueError(f"the run's arguments start with --config <yaml>, not {args[:1]}")
    out: list[str] = []
    it = iter(args)
    for arg in it:
        if arg == "--config":
            out += [arg, _absolute(next(it, ""))]
        elif arg.startswith("--config="):
            out.append("--config=" + _absolute(arg.split("=", 1)[1]))
        else:
            out.append(arg)
    first, rest = (out[1], out[2:]) if out[0] == "--config" else (out[0].split("=", 1)[1], out[1:])
    return {"config": first, "overrides": shlex.join(rest)}


def _absolute(path: str) -> str:
    # The server resolves a relative `config` against the app directory; here it is the user's working directory.
    return str(Path(path).resolve()) if Path(path).exists() else path


def main(argv: list[str] | None = None) -> None:
    """Command line: the simulation's options, then the run's ``--config <yaml>`` and overrides."""
    parser = argparse.ArgumentParser(
        prog="python -m fl_lightning.engines.flower_sim",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,  # the run's own --config/--federation.* arguments must not match ours by prefix
    )
    parser.add_argument("--num-supernodes", type=int, required=True, help="virtual SuperNodes (≤ clients)")
    parser.add_argument("--client-cpus", type=float, default=1.0, help="CPUs (and torch threads) per Ray actor")
    parser.add_argument("--client-gpus", type=float, default=0.0, help="GPUs per Ray actor (fractions allowed)")
    parser.add_argument("--state-dir", help="the sites' state directory (default: a temporary one)")
    parser.add_argument("--ray-num-cpus", type=int, help="CPUs Ray may use (default: every core)")
    parser.add_argument("--verbose", action="store_true", help="Flower's debug logging")
    # Everything imported so far lives as long as the process: out of the collector's way (see train.py).
    gc.freeze()
    opts, run = parser.parse_known_args(argv)
    if not run or not run[0].startswith("--config"):
        parser.error("after the options, give the run's --config <yaml> and its overrides")
    summary = simulate(
        run,
        opts.num_supernodes,
        client_cpus=opts.client_cpus,
        client_gpus=opts.client_gpus,
        state_dir=opts.state_dir,
        ray_init_args={"num_cpus": opts.ray_num_cpus} if opts.ray_num_cpus else None,
        verbose=opts.verbose,
    )
    print(json.dumps({"run_dir": summary.get("run_dir")}), file=sys.stderr)


if __name__ == "__main__":
    main()
