"""The Flower engine on the Simulation Engine: partition-id → hosted clients, one node served by several
processes, and (slow, needs Ray) run_simulation ≡ the in-process run."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")

import importlib  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

from fl_lightning.engines import flower_sim, flower_site  # noqa: E402
from fl_lightning.engines.flower_sim import _run_config  # noqa: E402
from fl_lightning.engines.flower_site import DEFAULT_STATE_DIR, Site, SiteSettings, site_for  # noqa: E402
from fl_lightning.wire import protocol  # noqa: E402
from fl_lightning.wire.protocol import Task  # noqa: E402
from tests.engines.deployment import ROOT  # noqa: E402
from tests.engines.test_flower import TINY, assert_same_weights, final_state, inprocess  # noqa: E402

IDS = [f"site{i}" for i in range(10)]
TINY3 = [*TINY, "--data.num_clients=3"]  # the later --data.num_clients wins: 3 clients on 2 SuperNodes


# ------------------------------------------------------------------------------------------------ partition-id
@pytest.mark.parametrize(
    ("index", "count", "hosted"),
    [
        (3, 10, ["site3"]),  # 10 SuperNodes, 10 clients: one each
        (0, 3, ["site0", "site3", "site6", "site9"]),  # fewer SuperNodes share: positions p % n == i
        (2, 3, ["site2", "site5", "site8"]),
        (0, 1, IDS),
    ],
)
def test_partition_id_hosts_every_nth_client_in_client_order(index: int, count: int, hosted: list[str]):
    settings = SiteSettings.from_node_config({"partition-id": index, "num-partitions": count})
    assert settings.partition == (index, count) and settings.clients is None
    assert settings.hosted(IDS) == hosted
    # the simulated nodes share one machine: each keeps its state in a folder of its own
    assert settings.state_dir == Path(DEFAULT_STATE_DIR).expanduser() / f"partition-{index}"


def test_every_client_is_hosted_by_exactly_one_partition():
    for count in (1, 2, 3, 7, 10):
        hosted = [c for i in range(count) for c in SiteSettings(partition=(i, count)).hosted(IDS)]
        assert sorted(hosted) == sorted(IDS), count


def test_named_clients_win_over_a_partition_and_the_state_dir_is_kept(tmp_path: Path):
    cfg = {"fl-clients": "site4", "partition-id": 0, "num-partitions": 2, "fl-state-dir": str(tmp_path)}
    settings = SiteSettings.from_node_config(cfg)
    assert settings.partition is None and settings.hosted(IDS) == ["site4"] and settings.state_dir == tmp_path
    sim = SiteSettings.from_node_config({"partition-id": 1, "num-partitions": 2, "fl-state-dir": str(tmp_path)})
    assert sim.state_dir == tmp_path / "partition-1"


@pytest.mark.parametrize(
    ("node_config", "match"),
    [
        ({"partition-id": 10, "num-partitions": 10}, "partition-id=10 must lie in 0 .. num-partitions-1"),
        ({"partition-id": -1, "num-partitions": 2}, "partition-id=-1 must lie"),
        ({"partition-id": 0}, r"\['num-partitions'\] missing"),
        ({"partition-id": "a", "num-partitions": 2}, "must be integers"),
    ],
)
def test_bad_partition_node_configs_are_named(node_config: dict, match: str):
    with pytest.raises(ValueError, match=match):
        SiteSettings.from_node_config(node_config)


def test_more_partitions_than_clients_is_an_error_naming_the_keys():
    settings = SiteSettings.from_node_config({"partition-id": 11, "num-partitions": 12})
    with pytest.raises(ValueError, match=r"num-partitions=12 \(this node's partition-id=11\) exceeds the 10 clients"):
        settings.hosted(IDS)


def test_the_cli_resolves_config_paths_and_joins_the_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "run.yaml").write_text("{}\n")
    (tmp_path / "more.yaml").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    cfg = _run_config(["--config", "run.yaml", "--federation.rounds=2", "--config=more.yaml", "--x", "a b"])
    assert cfg == {"config": str(tmp_path / "run.yaml"),
                   "overrides": f"--federation.rounds=2 --config={tmp_path / 'more.yaml'} --x 'a b'"}  # fmt: skip
    with pytest.raises(ValueError, match="start with --config"):
        _run_config(["--federation.rounds=2"])


# ---------------------------------------------------------------------------------------- one node, two processes
def test_a_node_served_by_two_processes_continues_from_the_others_state(tmp_path: Path):
    """Ray actors answer any virtual node: each message starts from the node's newest state on disk."""
    args = ["--config", str(ROOT / "configs/fedavg_digits.yaml"), *TINY3]
    settings = SiteSettings.from_node_config({"partition-id": 0, "num-partitions": 2, "fl-state-dir": str(tmp_path)})
    first, second = Site(args, settings), Site(args, settings)  # two actors' copies of node 0
    assert first.clients == ["site0", "site2"] and first.describe()["partitions"] == 2
    for site in (first, second):
        site.open_run("run", 0)
    state = {k: v.clone() for k, v in first.runtime.module.state_dict().items()}

    def fit(site: Site, client: str, round_index: int) -> None:
        task = Task(protocol.FIT, round_index, client, "global", state=state)
        assert protocol.decode(site.handle(protocol.encode(task))).error is None

    fit(first, "site0", 0)
    fit(second, "site2", 0)  # loads first's state: site0's sampler position survives second's save
    fit(first, "site0", 1)  # and back: first reloads second's file, its own copy being older
    fresh = Site(args, settings)
    fresh.open_run("run", 1)
    positions = fresh.runtime.data.sampler_state()
    assert positions == first.runtime.data.sampler_state()
    assert positions["site0"] == 2 * positions["site2"] > 0, positions
    assert (tmp_path / "partition-0" / "run" / "round-00001.flm").exists()


# ------------------------------------------------------------------------------------------------ Simulation Engine
@pytest.mark.slow
def test_fedavg_on_the_simulation_engine_equals_inprocess(tmp_path: Path):
    """run_simulation with 2 virtual SuperNodes for 3 clients (node 0 hosts two); FedAvg, 2 rounds ≡ in-process."""
    pytest.importorskip("ray", reason="the Simulation Engine needs Ray: pip install -e '.[flower-sim]'")
    config = "configs/fedavg_digits.yaml"
    cmd = [sys.executable, "-m", "fl_lightning.engines.flower_sim", "--num-supernodes", "2", "--client-cpus", "1",
           "--state-dir", str(tmp_path / "state"), "--config", str(ROOT / config), *TINY3,
           f"--federation.output_dir={tmp_path}/runs", "--federation.run_name=sim"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    run_dir = tmp_path / "runs" / "sim"
    for name in ("config.yaml", "metrics.csv", "rounds.csv", "summary.json"):
        assert (run_dir / name).exists(), name
    assert_same_weights(final_state(run_dir), final_state(inprocess(tmp_path, config, TINY3)))
    for i in range(2):  # each virtual node kept its state apart
        assert (tmp_path / "state" / f"partition-{i}" / "sim" / "round-00001.flm").exists()


def test_the_simulation_driver_starts_without_torch_or_lightning():
    """The driver starts Ray before it imports anything heavy: a thread imports torch and the ServerApp's Lightning
    while Ray starts; the apps' module alone still imports no Lightning."""
    probe = (
        "import sys, fl_lightning.engines.flower_sim; "
        "assert 'torch' not in sys.modules and 'flwr.simulation' not in sys.modules, 'imported before Ray starts'; "
        "import fl_lightning.engines.flower as f; "
        "assert 'lightning' not in sys.modules, 'lightning imported'; "
        "assert callable(f.make_server_app) and callable(f.make_client_app)"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)


def test_a_site_builds_without_importing_wandb(tmp_path: Path):
    """A site logs nothing: no W&B default logger whose type hints would import wandb (≈ 0.5 s per actor)."""
    probe = (
        "import sys; from pathlib import Path; from fl_lightning.engines.flower_site import Site, SiteSettings; "
        f"site = Site(['--config', 'configs/fedavg_digits.yaml', *{TINY!r}], SiteSettings(('site0',), (), "
        f"Path({str(tmp_path)!r}))); "
        "assert site.runtime.trainer.logger is None; assert 'wandb' not in sys.modules, 'wandb imported'"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)


def test_ray_starts_every_actor_with_the_warm_up_hook(monkeypatch: pytest.MonkeyPatch):
    """Each Ray actor's process starts importing Lightning at once (worker_process_setup_hook), not on its first
    message."""
    seen: dict = {}
    fake_ray = types.SimpleNamespace(is_initialized=lambda: False, init=lambda **kwargs: seen.update(kwargs))
    monkeypatch.setitem(sys.modules, "ray", fake_ray)  # what _start_ray passes, without starting Ray (or needing it)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # _start_ray extends it; restored after
    flower_sim._start_ray({}, verbose=False)
    module, _, name = seen["runtime_env"]["worker_process_setup_hook"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is flower_site.warm_up
    assert seen["runtime_env"]["env_vars"]["PYTHONPATH"].startswith(os.pathsep.join(sys.path))


def test_a_warmed_up_site_imports_once_and_uses_the_threads_ray_gave_its_actor(tmp_path: Path):
    """warm_up starts one import thread; site_for waits for it, and torch then takes the OMP_NUM_THREADS that Ray
    sets for an actor after its process (and the warm-up) started — not every core, which made two actors on two
    cores several times slower."""
    probe = (
        "import gc, os, sys, torch; from pathlib import Path; from fl_lightning.engines import flower_site as fs; "
        "os.environ.pop('OMP_NUM_THREADS', None); torch.set_num_threads(3); "
        "fs.warm_up(); first = fs._WARM_UP; fs.warm_up(); assert fs._WARM_UP is first, 'a second warm-up thread'; "
        "os.environ['OMP_NUM_THREADS'] = '1'; "
        f"site = fs.site_for('run', ['--config', 'configs/fedavg_digits.yaml', *{TINY!r}], "
        f"fs.SiteSettings(('site0',), (), Path({str(tmp_path)!r}))); "
        "assert not first.is_alive() and 'fl_lightning.cli' in sys.modules; "
        "assert gc.isenabled(), 'collector left off'; "
        "assert torch.get_num_threads() == 1, torch.get_num_threads()"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)


# ---------------------------------------------------------------------------------------- one process, many nodes
def _node(index: int, count: int, state_dir: Path) -> SiteSettings:
    return SiteSettings.from_node_config(
        {"partition-id": index, "num-partitions": count, "fl-state-dir": str(state_dir)}
    )


def test_the_sites_of_one_process_share_one_build_and_answer_as_if_built_alone(tmp_path: Path, monkeypatch):
    """A Ray actor serving several virtual nodes parses and instantiates the run once; each node gets a runtime."""
    monkeypatch.setattr(flower_site, "_SITES", {})
    monkeypatch.setattr(flower_site, "_BUILDS", {})
    args = ["--config", str(ROOT / "configs/fedbn_digits.yaml"), *TINY, "--data.num_clients=4"]
    shared = [site_for("run-a", args, _node(i, 2, tmp_path / "shared")) for i in range(2)]
    assert shared[0].runtime.module is shared[1].runtime.module and shared[0].runtime is not shared[1].runtime
    assert shared[0].clients == ["site0", "site2"] and shared[1].clients == ["site1", "site3"]
    trainer = shared[0].runtime.trainer
    assert sum(type(cb).__name__ == "FitProbe" for cb in trainer.callbacks) == 1  # one probe for the shared fits
    alone = [Site(args, _node(i, 2, tmp_path / "alone")) for i in range(2)]
    initial = {k: v.clone() for k, v in alone[0].runtime.module.state_dict().items()}
    for site in (*shared, *alone):
        site.open_run("run", 0)
    for round_index in range(2):  # round 1 starts from each client's private (BN) state of round 0
        for node, client in [(0, "site0"), (1, "site1"), (0, "site2"), (1, "site3")]:
            task = protocol.encode(Task(protocol.FIT, round_index, client, "global", state=initial))
            got, want = (protocol.decode(site.handle(task)) for site in (shared[node], alone[node]))
            assert got.error is None and want.error is None
            assert got.num_samples == want.num_samples and got.metrics == want.metrics, client
            assert_same_weights(got.state, want.state)
    for node in range(2):
        got, want = shared[node].runtime.state_dict(), alone[node].runtime.state_dict()
        assert got["private"].keys() == want["private"].keys() == set(alone[node].clients)
        for client in alone[node].clients:
            assert_same_weights(got["private"][client]["global"], want["private"][client]["global"])
        assert got["data"] == want["data"]
    # another run in this process starts from scratch
    assert site_for("run-b", args, _node(0, 2, tmp_path / "b")).runtime.module is not shared[0].runtime.module


def test_a_runtime_bound_callback_gives_every_node_its_own_build(tmp_path: Path, monkeypatch):
    """Domain Isolation keeps each runtime's clients' features in the callback object: no sharing across nodes."""
    monkeypatch.setattr(flower_site, "_SITES", {})
    monkeypatch.setattr(flower_site, "_BUILDS", {})
    args = ["--config", str(ROOT / "configs/scfl_digits_seg.yaml"), *TINY, "--data.num_clients=4"]
    first, second = (site_for("run-ddi", args, _node(i, 2, tmp_path)) for i in range(2))
    assert first.runtime.module is not second.runtime.module
    assert first.runtime.callbacks[0] is not second.runtime.callbacks[0]
    assert flower_site._BUILDS == {}
