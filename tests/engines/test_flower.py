"""The Flower engine: wire format, a site's state on disk, and a real loopback deployment ≡ the in-process run."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")

import csv  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fl_lightning.cli import main  # noqa: E402
from fl_lightning.engines import flower_site  # noqa: E402
from fl_lightning.engines.flower import PRECONDITION, FlowerTransport, answer, pack, unpack  # noqa: E402
from fl_lightning.engines.flower_site import Site, SiteSettings  # noqa: E402
from fl_lightning.errors import PreconditionError  # noqa: E402
from fl_lightning.outputs.checkpoint import find_last_checkpoint  # noqa: E402
from fl_lightning.wire import protocol  # noqa: E402
from fl_lightning.wire.protocol import Task  # noqa: E402
from tests.engines.deployment import ROOT, Deployment  # noqa: E402

TINY = [
    "--data.num_clients=2", "--data.image_size=8", "--model.width=4", "--data.max_samples_per_client=40",
    "--federation.rounds=2", "--federation.eval_every=0", "--federation.progress=false",
]  # fmt: skip


@pytest.fixture
def deployment(tmp_path: Path):
    d = Deployment(tmp_path)
    try:
        yield d
    finally:
        d.stop()


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    found = find_last_checkpoint(run_dir)
    assert found is not None, f"no checkpoint in {run_dir}"
    return found[1]["groups"][0]["state"]


def inprocess(tmp_path: Path, config: str, extra: list[str]) -> Path:
    main(["--config", str(ROOT / config), *extra, f"--federation.output_dir={tmp_path}/inproc",
          "--federation.run_name=inproc", "--trainer.logger=false"])  # fmt: skip
    return tmp_path / "inproc" / "inproc"


def deploy(d: Deployment, config: str, extra: list[str], sites: int = 2, done: str = "summary.json") -> Path:
    d.start_superlink()
    for i in range(sites):
        d.start_supernode(f"node{i}", f'fl-clients="site{i}" fl-state-dir="{d.workdir}/site{i}"')
    return submit(d, config, extra, "flower", sites, done)


def submit(d: Deployment, config: str, extra: list[str], name: str, sites: int = 2, done: str = "summary.json") -> Path:
    """Run ``config`` on the deployment's SuperNodes as run ``name``; its run directory once ``done`` is written."""
    overrides = " ".join([*extra, f"--federation.output_dir={d.workdir}/runs", f"--federation.run_name={name}"])
    run_dir = d.workdir / "runs" / name
    d.flwr_run(f'config="{config}" overrides="{overrides}" min-nodes={sites} poll=0.02', run_dir / done)
    return run_dir


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs (max |Δ| {(a[k].double() - b[k].double()).abs().max()})"


# ------------------------------------------------------------------------------------------------ no processes
def test_wire_carries_the_encoded_message_whole():
    task = Task(protocol.FIT, 3, "site0", "global", state={"w": torch.arange(6.0).reshape(2, 3)}, epochs=2)
    data = protocol.encode(task)
    got, meta = unpack(pack(data, op="task", run="r", round=3))
    assert got == data and meta == {"op": "task", "run": "r", "round": 3}
    back = protocol.decode(got)
    assert torch.equal(back.state["w"], task.state["w"]) and back.epochs == 2


def test_site_describes_only_metadata_and_resumes_its_state_from_disk(tmp_path: Path):
    args = ["--config", str(ROOT / "configs/fedavg_digits.yaml"), *TINY]
    site = Site(args, SiteSettings(("site1",), (), tmp_path))
    desc = site.describe()
    assert set(desc["clients"]) == {"site1"} and desc["image_size"] == [8, 8] and desc["num_classes"] == 10
    site.open_run("run-a", 0)
    state = {k: v.clone() for k, v in site.runtime.module.state_dict().items()}
    reply = protocol.decode(site.handle(protocol.encode(Task(protocol.FIT, 0, "site1", "global", state=state))))
    assert reply.error is None and reply.num_samples == desc["clients"]["site1"][0]
    assert (tmp_path / "run-a" / "round-00000.flm").exists()
    with pytest.raises(protocol.MessageError, match="not hosted here"):
        site.handle(protocol.encode(Task(protocol.FIT, 0, "site0", "global", state=state)))
    # a fresh process (a restarted node) reads the sampler position back: its next fit draws the same batches
    again = Site(args, SiteSettings(("site1",), (), tmp_path))
    again.open_run("run-a", 1)
    assert again.runtime.data.sampler_state() == site.runtime.data.sampler_state()


def test_a_sites_precondition_error_stops_the_run_instead_of_failing_its_client(tmp_path: Path, monkeypatch):
    """SCAFFOLD needs plain SGD: a site with momentum answers with the reason, and the server raises it (in one
    process the run stops with it too); Flower alone would only say the ClientApp raised, a failed client."""
    from flwr.app import Context, Message, Metadata, RecordDict

    monkeypatch.setattr(flower_site, "_SITES", {})
    monkeypatch.setattr(flower_site, "_BUILDS", {})
    overrides = " ".join([*TINY, "--model.momentum=0.9"])
    run_cfg = {"config": str(ROOT / "configs/scaffold_digits_dirichlet.yaml"), "overrides": overrides}
    node_cfg = {"fl-clients": "site0", "fl-state-dir": str(tmp_path)}
    context = Context(run_id=1, node_id=7, node_config=node_cfg, state=RecordDict(), run_config=run_cfg)
    task = protocol.encode(Task(protocol.FIT, 0, "site0", "global", state={}))
    metadata = Metadata(1, "m1", 1, 7, "", "", time.time(), 60.0, "train")  # as the SuperLink delivers it
    message = Message(pack(task, op="task", run="run", round=0), metadata=metadata)
    _data, meta = unpack(answer(message, context).content)
    assert "SCAFFOLD" in meta[PRECONDITION] and "momentum" in meta[PRECONDITION]

    transport = FlowerTransport(grid=None)  # type: ignore[arg-type]  # no messages leave: _exchange is replaced
    transport.routes, transport.descriptions = {"site0": 7}, {7: {}}
    monkeypatch.setattr(transport, "node_ids", lambda: [7])
    monkeypatch.setattr(transport, "_exchange", lambda items: [(b"", meta, None)] * len(items))
    with pytest.raises(PreconditionError, match=r"client 'site0' \(SuperNode 7\): .*SCAFFOLD"):
        transport.request(Task(protocol.FIT, 0, "site0", "global", state={}))
    monkeypatch.setattr(transport, "_exchange", lambda items: [(b"", {}, "the ClientApp raised")] * len(items))
    assert "failed" in transport.request(Task(protocol.FIT, 0, "site0", "global", state={})).error  # other errors


# ------------------------------------------------------------------------------------------------ deployment
def test_fedavg_over_a_loopback_deployment_equals_inprocess(deployment: Deployment, tmp_path: Path):
    """SuperLink + two SuperNodes (a site each) on 127.0.0.1; FedAvg for 2 rounds ≡ the in-process run, bit for bit."""
    config = "configs/fedavg_digits.yaml"
    run_dir = deploy(deployment, config, TINY)
    reference = inprocess(tmp_path, config, TINY)
    assert_same_weights(final_state(run_dir), final_state(reference))
    for name in ("config.yaml", "metrics.csv", "rounds.csv", "summary.json", "environment.json", "curves.png"):
        assert (run_dir / name).exists(), name
    # the server's checkpoint holds no site state, only the round each site keeps its own state for
    ckpt = find_last_checkpoint(run_dir)[1]
    assert ckpt["runtime"] == {"engine": "flower", "run": "flower", "round": 1}
    for i in range(2):
        assert (deployment.workdir / f"site{i}" / "flower" / "round-00001.flm").exists()
    assert "DescribedClients" not in (run_dir / "config.yaml").read_text()


@pytest.mark.slow  # the evaluation's logic is covered by test_cross_site.py and on ranks by test_distributed.py
def test_mode_evaluate_over_a_deployment_scores_the_weights_as_in_process(deployment: Deployment, tmp_path: Path):
    """``federation.mode: evaluate`` on Flower sites: each site scores the given checkpoint on its own test set, with
    the per-client metrics of the in-process evaluation (no pooled metrics: the predictions stay on the sites)."""
    config = "configs/fedavg_digits.yaml"
    trained = inprocess(tmp_path / "train", config, TINY)
    weights = find_last_checkpoint(trained)[0]
    extra = [*TINY, "--federation.mode=evaluate", f"--federation.weights={weights}"]
    site = json.loads((deploy(deployment, config, extra) / "summary.json").read_text())
    local = json.loads((inprocess(tmp_path, config, extra) / "summary.json").read_text())
    assert site["weights"] == local["weights"] == str(weights)
    assert site["clients"] == local["clients"] and site["summary"] == local["summary"]
    assert "pooled" not in site and "pooled" in local


@pytest.mark.slow  # the logic: test_stats.py and test_secure_stats.py in process, test_distributed.py on ranks
def test_federated_statistics_over_a_deployment_equal_in_process_in_the_clear_and_securely(
    deployment: Deployment, tmp_path: Path
):
    """``python -m fl_lightning.stats`` on Flower sites: the clear release and the secure sum (fresh keys on each
    SuperNode, masks that cancel) give the in-process statistics."""
    config = "configs/fedavg_digits.yaml"
    extra = [*TINY, "--federation.mode=stats", "--federation.stats_min_count=3"]
    clear = json.loads((deploy(deployment, config, extra, done="stats.json") / "stats.json").read_text())
    secure_extra = [*extra, "--federation.stats_secure=true"]
    secure_dir = submit(deployment, config, secure_extra, "secure", done="stats.json")
    secure = json.loads((secure_dir / "stats.json").read_text())
    local = json.loads((inprocess(tmp_path, config, extra) / "stats.json").read_text())
    assert clear["sites"] == local["sites"] and clear["pooled"] == local["pooled"]
    local_secure = json.loads((inprocess(tmp_path / "s", config, secure_extra) / "stats.json").read_text())
    assert secure["pooled"] == local_secure["pooled"] and secure["secure"] == local_secure["secure"]
    # the clear pool lacks each site's cells under min_count; the secure one has them all (and withholds its own)
    assert secure["pooled"]["train"]["n"] == clear["pooled"]["train"]["n"]
    assert sum(secure["pooled"]["train"]["labels"]) == secure["pooled"]["train"]["n"]


def test_the_round_chosen_on_validation_over_a_deployment_equals_inprocess(deployment: Deployment, tmp_path: Path):
    """FedBN with select: best: the sites count their validation sets, keep their norm layers of the best round on
    their own disk, and the test sets are read once at the end; the summary equals the in-process one."""
    config = "configs/fedbn_digits.yaml"
    extra = [*TINY, "--federation.rounds=3", "--federation.eval_every=1", "--data.val_fraction=0.25",
             "--federation.select=best", "--federation.monitor=val/personal/acc_mean"]  # fmt: skip
    site, local = (json.loads((d / "summary.json").read_text())
                   for d in (deploy(deployment, config, extra), inprocess(tmp_path, config, extra)))  # fmt: skip
    assert site["selection"]["split"] == "val"
    for key in ("selection", "summary", "clients"):
        assert site.get(key) == local.get(key), key
    # the pooled model's test metrics need every prediction in one place: a simulation computes them, a site's
    # predictions never leave it (evaluation.py), so over a deployment only the per-client part is compared
    assert "pooled" not in site["last_round"] and "pooled" in local["last_round"]
    assert site["last_round"] == {k: v for k, v in local["last_round"].items() if k != "pooled"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        "configs/scaffold_digits_dirichlet.yaml",  # c travels down, Δc_i up; c_i stays on its site's disk
        "configs/fedbn_digits.yaml",  # norm layers stay on the sites
        "configs/fedprox_digits.yaml",
        "configs/fedshift_digits_dirichlet.yaml",  # secure sum of class counts through query messages
        "configs/harmofl_digits.yaml",
        "configs/feder_digits.yaml",  # peer-to-peer: buffers and models relayed by the ServerApp
        "configs/dpsgd_digits.yaml",  # each site's accountant stays in its state directory
        "configs/dpfedavg_digits.yaml",  # clipped on the sites, noised on the server
        "configs/fedavg_secagg_digits.yaml",  # pairwise masks: keys through the query messages
        "configs/fedper_digits.yaml",  # the heads never leave their sites
        "configs/fedrep_digits_dirichlet.yaml",  # the head's epochs first: the sites' epoch budget
        "configs/lg_fedavg_digits.yaml",  # the bodies never leave their sites
        "configs/fedbabu_digits_dirichlet.yaml",  # the head frozen; fine-tuned on each site at the end
        "configs/ditto_digits_dirichlet.yaml",  # the personal models stay on their sites
        "configs/mr_mtl_digits.yaml",
        "configs/apfl_digits.yaml",  # v_i and α_i stay on their sites
        "configs/fedala_digits_dirichlet.yaml",  # θ_i and W_i stay on their sites
    ],
)
def test_method_over_a_loopback_deployment_equals_inprocess(deployment: Deployment, tmp_path: Path, config: str):
    run_dir = deploy(deployment, config, TINY)
    assert_same_weights(final_state(run_dir), final_state(inprocess(tmp_path, config, TINY)))


@pytest.mark.slow
def test_cyclic_weight_transfer_over_a_loopback_deployment_equals_inprocess(deployment: Deployment, tmp_path: Path):
    """One model passed from site to site (through the ServerApp, one fit task at a time) ≡ the in-process cycle."""
    config, extra = "configs/fedavg_digits.yaml", [*TINY, "--federation.topology=cyclic"]
    run_dir = deploy(deployment, config, extra)
    assert_same_weights(final_state(run_dir), final_state(inprocess(tmp_path, config, extra)))


@pytest.mark.slow
def test_a_killed_site_and_a_corrupt_reply_fail_their_clients_and_a_rerun_resumes_exactly(
    deployment: Deployment, tmp_path: Path
):
    """Three SuperNodes: in round 2 one is killed mid-fit and another sends NaN weights (tests/engines/faults.py).
    The run finishes with both recorded as failed clients of round 2; the restarted site trains again. A rerun
    without failures resumes from the last checkpoint: twice from copies of it, bit-identical (nothing outside the
    checkpoint and the sites' states of its round decides what follows)."""
    d = deployment
    d.env["PYTHONPATH"] = str(ROOT)  # the server and the sites import the fault from tests/
    overlay = tmp_path / "faults.yaml"
    overlay.write_text(
        "trainer:\n  callbacks:\n    - class_path: tests.engines.faults.CorruptReply\n"
        "      init_args: {client_id: site2, round: 1}\n"
    )
    d.start_superlink()
    node = {i: (f"node{i}", f'fl-clients="site{i}" fl-state-dir="{d.workdir}/site{i}"') for i in range(3)}
    for i in range(3):
        d.start_supernode(*node[i])
    extra = [*TINY, "--data.num_clients=3", f"--config={overlay}", "--federation.rounds=4",
             "--federation.local_epochs=20", "--federation.reply_timeout=25"]  # fmt: skip

    def run_config(name: str, *more: str) -> str:
        overrides = " ".join(
            [*extra, *more, f"--federation.output_dir={d.workdir}/runs", f"--federation.run_name={name}"]
        )
        return f'config="configs/fedavg_digits.yaml" overrides="{overrides}" min-nodes=3 poll=0.02'

    run_dir = d.workdir / "runs" / "flower"
    errors: list[BaseException] = []
    ids: list[int] = []

    def submit() -> None:
        try:
            ids.append(d.flwr_run(run_config("flower"), run_dir / "summary.json", timeout=500))
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)

    runner = threading.Thread(target=submit)
    runner.start()
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "round-00001.ckpt").exists():
        assert time.monotonic() < deadline and not errors, errors or "round 1 never finished"
        time.sleep(0.05)
    d.kill_node("node1")  # mid round 2: the server has just sent its fit tasks
    time.sleep(30)  # past federation.reply_timeout: round 2 ends without site1 (and without site2's NaN)
    d.start_supernode(*node[1])
    runner.join(timeout=520)
    assert not errors, errors
    rows = list(csv.DictReader((run_dir / "rounds.csv").open()))
    failed = [int(float(r["round/failed_clients"])) for r in rows]
    assert len(rows) == 4 and failed[0] == 0 and failed[1] == 2 and failed[-1] == 0, failed
    clients = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert {r["client"] for r in clients if r["round"] == "2" and r["failed"] == "1"} == {"site1", "site2"}
    assert {r["client"] for r in clients if r["round"] == "4" and r.get("train_steps")} == {"site0", "site1", "site2"}
    log = d.run_log(ids[0])
    assert "client 'site2' failed and is left out of this round: its reply failed the server's checks" in log, log
    assert "client 'site1' failed and is left out of this round: its SuperNode" in log, log

    # the rerun: its twin starts from copies of the same checkpoint and site states
    shutil.copytree(run_dir, d.workdir / "runs" / "twin")
    for i in range(3):
        shutil.copytree(d.workdir / f"site{i}" / "flower", d.workdir / f"site{i}" / "twin")
    first_rows = (run_dir / "rounds.csv").read_text().splitlines()
    for name in ("flower", "twin"):
        summary = d.workdir / "runs" / name / "summary.json"
        summary.unlink()
        d.flwr_run(run_config(name, "--federation.rounds=5", "--federation.resume=last"), summary, timeout=300)
    resumed = (run_dir / "rounds.csv").read_text().splitlines()
    assert resumed[: len(first_rows)] == first_rows and len(resumed) == len(first_rows) + 1
    assert json.loads((run_dir / "resume_changes.json").read_text())[-1]["after_round"] == 4
    assert_same_weights(final_state(run_dir), final_state(d.workdir / "runs" / "twin"))
    assert int(float(list(csv.DictReader((run_dir / "rounds.csv").open()))[-1]["round/failed_clients"])) == 0


@pytest.mark.slow
def test_scfl_over_a_loopback_deployment_equals_inprocess(deployment: Deployment, tmp_path: Path):
    """DDI's per-class EM, assignment and the selector's own federation, all as query messages to the sites."""
    overlay = tmp_path / "scfl_small.yaml"
    overlay.write_text(
        "trainer:\n  callbacks:\n    - class_path: callbacks.DomainIsolation\n      init_args: {split_round: 1, "
        "prune_fraction: 0.05, selector_rounds: 2, selector_local_steps: 2, plots: false}\n"
    )
    extra = [f"--config={overlay}", "--data.num_clients=2", "--data.num_samples=60", "--data.image_size=16",
             "--model.width=4", "--federation.rounds=2", "--federation.eval_every=0",
             "--federation.progress=false"]  # fmt: skip
    run_dir = deploy(deployment, "configs/scfl_digits_seg.yaml", extra)
    assert_same_weights(final_state(run_dir), final_state(inprocess(tmp_path, "configs/scfl_digits_seg.yaml", extra)))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["domain_isolation"]["split"] is True


def test_fedavg_with_flowers_secaggplus_over_a_loopback_deployment(deployment: Deployment, tmp_path: Path):
    """Flower's secaggplus_mod on both SuperNodes, its four stages driven by our transport: the plain run's weights
    within SecAgg+'s quantisation bound; the server refuses any decoded reply holding a client's update.

    One round: each SecAgg+ stage is a round trip through SuperNodes that poll every 3 s when idle.
    """
    overlay = tmp_path / "secaggplus.yaml"
    overlay.write_text(
        "trainer:\n  callbacks:\n    - class_path: callbacks.SecureAggregation\n"
        "      init_args: {scheme: secaggplus, clipping_range: 1.0, quantization_range: 1073741824}\n"
    )
    extra = [*TINY, "--federation.rounds=1"]
    run_dir = deploy(deployment, "configs/fedavg_digits.yaml", [*extra, f"--config={overlay}"])
    plain = final_state(inprocess(tmp_path, "configs/fedavg_digits.yaml", extra))
    secure = final_state(run_dir)
    quantum = 2 * 1.0 / 2**30  # 2c/T: each of the m = 2 clients' stochastic rounding errs by less than one step
    for k, v in plain.items():
        if v.is_floating_point():  # plus float32 rounding of w + Σ p_i Δ_i (the plain run sums in float32)
            bound = 2 * quantum + 4 * torch.finfo(torch.float32).eps * v.abs().max().item()
            diff = (secure[k].double() - v.double()).abs().max().item()
            assert diff <= bound, f"{k}: |Δ| {diff:.3g} > {bound:.3g}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["secure_aggregation"]["scheme"] == "secaggplus"
    node_log = (deployment.workdir / "node0.log").read_text()
    assert node_log.count("Sending: train message") == 4  # setup, share keys, masked vector, unmask
