"""torch.distributed: clients sharded over ranks give exactly the one-process results; resume across rank counts.

The multi-rank runs share one spawn of 2 ranks (gloo, 127.0.0.1, ephemeral ports): each rank runs the
list of runs in turn, so the suite pays the processes' start-up once.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fl_lightning.cli import main
from fl_lightning.engines import distributed
from fl_lightning.engines.local_ranks import free_port
from fl_lightning.outputs.checkpoint import checkpoint_path
from tests.anchors.runs import RUNS, describe, run_args
from tests.engines.torchrun_stand_in import spawn

REPO = Path(__file__).resolve().parents[2]
QUIET = ["--federation.quiet=true"]
RESUME_BASE = [  # FedBN + FedProx, momentum kept: private layers, optimiser states and a callback, all sharded
    "--config", str(REPO / "configs/fedbn_digits.yaml"), "--trainer.callbacks+=callbacks.FedProx",
    "--trainer.callbacks.mu=0.1", "--federation.keep_optimizer_state=true", "--federation.rounds=3",
    "--data.max_samples_per_client=40", "--data.image_size=8", "--model.width=4", "--trainer.logger=false",
    "--federation.plots=false", "--federation.keep_checkpoints=0", *QUIET,
]  # fmt: skip


# The privacy callbacks on 1 and 2 ranks: DP-SGD's accountants live in the clients' states (sharded with them),
# DP-FedAvg's noise is drawn on the server; both must give the one-process weights and ε.
PRIVACY_SMALL = ["--trainer.logger=false", "--federation.rounds=2", "--federation.plots=false",
                 "--data.max_samples_per_client=60", "--data.image_size=8", "--model.width=4",
                 "--federation.keep_checkpoints=0", *QUIET]  # fmt: skip
DP_RUNS = {name: ["--config", str(REPO / f"configs/{name}_digits.yaml"), *PRIVACY_SMALL]
           for name in ("dpsgd", "dpfedavg")}  # fmt: skip
# Secure aggregation on 1 and 2 ranks: the X25519 keys (OS randomness, in the sharded clients' states) and so the
# masks differ from run to run, but the masks cancel exactly modulo 2^64 and round(2^bits · p_i Δ_i) is a function
# of the update alone, so the unmasked sum, hence the weights, must not depend on the keys or the number of ranks.
SECAGG_RUNS = {
    "fedavg_secagg": ["--config", str(REPO / "configs/fedavg_secagg_digits.yaml"), *PRIVACY_SMALL],
    "dpfedavg_secagg": [  # each client noises its clipped update (noise: distributed), then masks it
        "--config", str(REPO / "configs/dpfedavg_digits.yaml"), "--trainer.callbacks.noise=distributed",
        "--trainer.callbacks+=callbacks.SecureAggregation", *PRIVACY_SMALL,
    ],
}  # fmt: skip
# DP-SGD with a dropout layer: Poisson batches and dropout masks both random, carried exactly across ranks and resume.
DROPOUT_RUNS = {"dpsgd_dropout": [*DP_RUNS["dpsgd"], "--model.net=tests.engines.dropout_net.DropoutCNN"]}
PRIVACY_RUNS = {**DP_RUNS, **SECAGG_RUNS, **DROPOUT_RUNS}
# Model selection on a validation split: the kept states (server groups, the clients' private norm layers) are
# sharded with the clients, and the test sets are read once for the chosen round, on any number of ranks.
SELECT_ARGS = ["--data.val_fraction=0.25", "--federation.select=best", "--federation.rounds=4",
               "--federation.monitor=val/personal/acc_mean"]  # fmt: skip


# Cyclic weight transfer (one model passed from rank to rank), the private heads of FedPer and FedRep and LG-FedAvg's
# private bodies, FedBABU's fine-tuning, the personal models of Ditto, MR-MTL, APFL and FedALA, a local run's
# cross-site matrix (every model to every rank's clients) and mode evaluate (a saved model scored on every rank's
# clients): as in one process.
TOPOLOGY_RUNS = {
    "cyclic": ["--federation.topology=cyclic"],
    "local_cross": ["--federation.mode=local"],
    "fedper": ["--trainer.callbacks+=callbacks.FedPer"],  # the heads stay on their ranks, never sent
    # whole personal models, α and their ages on their ranks; two of three clients a round, so some grow old
    "apfl": ["--trainer.callbacks+=callbacks.APFL", "--federation.client_fraction=0.67"],
    # each client's own model and aggregation weights on its rank; the adaptation's sample seeded by client and round
    "fedala": ["--trainer.callbacks+=callbacks.FedALA", "--federation.client_fraction=0.67"],
    "ditto": ["--trainer.callbacks+=callbacks.Ditto", "--federation.client_fraction=0.67"],
    "mr_mtl": ["--trainer.callbacks+=callbacks.MRMTL", "--federation.client_fraction=0.67"],
    "fedrep": ["--trainer.callbacks+=callbacks.FedRep"],
    "lg_fedavg": ["--trainer.callbacks+=callbacks.LGFedAvg"],
    # the head frozen at its shared initialisation, then each rank's clients fine-tuned at the end
    "fedbabu": ["--trainer.callbacks+=callbacks.FedBABU", "--trainer.callbacks+=callbacks.LocalFineTuning"],
}
TOPOLOGY_BASE = ["--config", str(REPO / "configs/fedavg_digits.yaml"), *PRIVACY_SMALL]


def topology_args(out: Path, name: str, *extra: str) -> list[str]:
    return [*TOPOLOGY_BASE, *TOPOLOGY_RUNS[name], f"--federation.output_dir={out}", f"--federation.run_name={name}",
            *extra]  # fmt: skip


def evaluate_args(out: Path, weights: Path) -> list[str]:
    return [*TOPOLOGY_BASE, "--federation.mode=evaluate", f"--federation.weights={weights}",
            f"--federation.output_dir={out}", "--federation.run_name=evaluate"]  # fmt: skip


STATS_RUNS = {"stats": [], "stats-secure": ["--federation.stats_secure=true"]}


def stats_args(out: Path, name: str = "stats") -> list[str]:
    """Federated statistics (mode stats): every rank's clients answer their stats tasks (in a secure sum too)."""
    return [*TOPOLOGY_BASE, "--federation.mode=stats", "--federation.stats_min_count=3", *QUIET,
            f"--federation.output_dir={out}", f"--federation.run_name={name}", *STATS_RUNS[name]]  # fmt: skip


def dp_args(out: Path, name: str, run_name: str, *extra: str) -> list[str]:
    return [*PRIVACY_RUNS[name], f"--federation.output_dir={out}", f"--federation.run_name={run_name}", *extra]


def resume_args(out: Path, name: str, *extra: str) -> list[str]:
    return [*RESUME_BASE, f"--federation.output_dir={out}", f"--federation.run_name={name}", *extra]


def run_on_two_ranks(jobs: list[list[str]]) -> None:
    """Spawn 2 ranks once; each runs ``jobs`` in turn, every run in its own process group (its own port)."""
    spawn(_run_jobs, 2, ([(argv, free_port()) for argv in jobs],))


def _run_jobs(jobs: list[tuple[list[str], int]]) -> None:
    # run_rank hides torchrun's variables from the Trainer: put them back before each run
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    for argv, port in jobs:
        os.environ.update(env, MASTER_PORT=str(port))
        main(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run once: one process, then two ranks, then the 2 → 1 resume in one process."""
    root = tmp_path_factory.mktemp("distributed")
    one, two = root / "one", root / "two"
    for name in RUNS:  # the seven methods of the regression anchor, one process
        main(run_args(name, one, QUIET))
    main(resume_args(root, "uninterrupted"))
    main(resume_args(root, "one-two", "--federation.rounds=1"))  # 1 → 2: the first round in one process
    for name in PRIVACY_RUNS:
        main(dp_args(one, name, name))
    main(dp_args(root, "dpsgd_dropout", "dpsgd-one-two", "--federation.rounds=1"))
    main(resume_args(one, "select", *SELECT_ARGS))
    for name in TOPOLOGY_RUNS:
        main(topology_args(one, name))
    for name in STATS_RUNS:
        main(stats_args(one, name))
    weights = root / "cyclic-round-2.ckpt"
    weights.write_bytes(checkpoint_path(one / "cyclic", 2).read_bytes())
    main(evaluate_args(one, weights))
    jobs = [run_args(name, two, QUIET) for name in RUNS]
    jobs += [topology_args(two, name) for name in TOPOLOGY_RUNS]
    jobs.append(evaluate_args(two, weights))
    jobs += [stats_args(two, name) for name in STATS_RUNS]
    jobs.append(resume_args(two, "select", *SELECT_ARGS))
    jobs += [dp_args(two, name, name) for name in PRIVACY_RUNS]
    jobs.append(dp_args(root, "dpsgd_dropout", "dpsgd-one-two", "--federation.resume=last"))
    jobs.append(resume_args(root, "two-one", "--federation.rounds=1"))  # 2 → 1: the first round on two ranks
    jobs.append(resume_args(root, "one-two", "--federation.resume=last"))
    run_on_two_ranks(jobs)
    main(resume_args(root, "two-one", "--federation.resume=last"))
    # The command line's own path: train.py parses the config, starts rank 1 and is rank 0 (local_ranks.py).
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *resume_args(root, "train-py-two"),
                           "--federation.workers=2"], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_give_the_one_process_final_state_bit_for_bit(runs, name):
    one, two = describe(runs / "one" / name), describe(runs / "two" / name)
    assert two["sha256"] == one["sha256"]
    assert two["summary"] == one["summary"]


@pytest.mark.parametrize("name", list(STATS_RUNS))
def test_federated_statistics_on_two_ranks_equal_one_process(runs, name):
    # A secure sum's masks are fresh on every run, yet they cancel exactly: the pooled sums are the same bits.
    one = json.loads((runs / "one" / name / "stats.json").read_text())
    assert json.loads((runs / "two" / name / "stats.json").read_text()) == one
    assert one["pooled"]["train"]["sites"] == len(one["sites"]) > 1
    assert ("secure" in one) == (name == "stats-secure")


@pytest.mark.parametrize("name", list(TOPOLOGY_RUNS))
def test_cyclic_fedper_and_cross_site_on_two_ranks_equal_one_process(runs, name):
    one, two = describe(runs / "one" / name), describe(runs / "two" / name)
    assert two["sha256"] == one["sha256"] and two["summary"] == one["summary"]
    if name == "local_cross":
        assert (runs / "two" / name / "cross_site.csv").read_text() == (
            runs / "one" / name / "cross_site.csv"
        ).read_text()


def test_evaluate_mode_on_two_ranks_scores_as_one_process(runs):
    read = lambda side: json.loads((runs / side / "evaluate" / "summary.json").read_text())  # noqa: E731
    one, two = read("one"), read("two")
    assert one["clients"] == two["clients"] and one["pooled"] == two["pooled"]
    assert one["rounds"] == 0 and one["weights"].endswith("cyclic-round-2.ckpt")


def test_train_py_with_two_workers_gives_the_one_process_final_state_bit_for_bit(runs):
    two, one = describe(runs / "train-py-two"), describe(runs / "uninterrupted")
    assert two["sha256"] == one["sha256"]
    assert json.loads((runs / "train-py-two" / "summary.json").read_text())["rounds"] == 3


@pytest.mark.parametrize("name", ["one-two", "two-one"])
def test_resume_with_another_number_of_ranks_is_exact(runs, name):
    assert describe(runs / name)["sha256"] == describe(runs / "uninterrupted")["sha256"]
    rows = [r for r in (runs / name / "rounds.csv").read_text().splitlines()]
    assert len(rows) == 4  # header + 3 rounds, one of them from the other number of ranks


def comm_columns(run: Path) -> list[dict[str, str]]:
    """The ``comm/*`` columns of every row of a run's rounds.csv."""
    with (run / "rounds.csv").open(newline="") as f:
        return [{k: v for k, v in row.items() if k.startswith("comm/")} for row in csv.DictReader(f)]


@pytest.mark.parametrize("name", [*RUNS, *PRIVACY_RUNS])
def test_two_ranks_report_the_one_process_traffic_byte_for_byte(runs, name):
    # The counts are the tasks' and replies' encoded sizes: no rank envelope, timing or control message in them.
    one, two = comm_columns(runs / "one" / name), comm_columns(runs / "two" / name)
    assert one and all(int(row["comm/bytes_down"]) > 0 for row in one)
    assert two == one


@pytest.mark.parametrize("name", ["one-two", "two-one"])
def test_resume_with_another_number_of_ranks_reports_the_same_traffic(runs, name):
    assert comm_columns(runs / name) == comm_columns(runs / "uninterrupted")


def test_outputs_only_from_rank_zero_with_per_rank_throughput(runs):
    run = runs / "two" / "fedavg_digits"
    header = (run / "rounds.csv").read_text().splitlines()[0].split(",")
    assert {"throughput/rank0/samples_per_s", "throughput/rank1/samples_per_s"} <= set(header)
    # none per rank
    assert sorted(p.name for p in (runs / "two").iterdir() if p.is_dir()) == sorted(
        [*RUNS, *PRIVACY_RUNS, *TOPOLOGY_RUNS, *STATS_RUNS, "select", "evaluate"]
    )
    assert json.loads((run / "summary.json").read_text())["rounds"] == 2


def test_two_ranks_choose_the_round_and_report_its_test_metrics_as_one_process(runs):
    one, two = (json.loads((runs / side / "select" / "summary.json").read_text()) for side in ("one", "two"))
    assert one["selection"]["monitor"] == "val/personal/acc_mean" and one["selection"]["split"] == "val"
    for key in ("selection", "summary", "clients", "last_round"):
        assert one.get(key) == two.get(key), key


def test_shards_are_balanced_by_training_samples_and_deterministic():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 40, "e": 10}
    owner = distributed.shard_clients(sizes, 2)
    loads = [sum(n for c, n in sizes.items() if owner[c] == r) for r in range(2)]
    assert owner == distributed.shard_clients(dict(reversed(sizes.items())), 2)  # order of the dict is irrelevant
    # largest first to the least-loaded rank: a 100, b 60, c 50 (rank 1: 110), d 40 (rank 0: 140), e 10 (rank 1)
    assert loads == [140, 120] and owner["__pooled__"] == 0
    assert [c for c in sizes if owner[c] == 1] == ["b", "c", "e"]
    assert set(distributed.shard_clients(sizes, 8).values()) == {0, 1, 2, 3, 4}  # never more ranks than clients used


def test_runtime_state_splits_by_owner_and_merges_back():
    state = {
        "private": {"a": {"g": 1}, "b": {"g": 2}},
        "optimizer_states": {"b": {"g": 3}},
        "callback_states": {"a": {"X": {"c_i": 4}}},
        "subset_samplers": {},
        "data": {"a": 1, "b": 2, "__pooled__": 0},
        "callbacks": {"X": {}},
        "generations": {"a": 3, "b": 1},
        "personal": {"b": {"g": {"w": 5}}},
        "fit_rounds": {"a": {"g": 0}, "b": {"g": 2}},
        "kept_round": {"a": 1},
    }
    owner = {"a": 0, "b": 1, "__pooled__": 0}
    parts = [distributed.split_runtime_state(state, owner, r) for r in (0, 1)]
    assert parts[1]["private"] == {"b": {"g": 2}} and parts[0]["data"] == {"a": 1, "__pooled__": 0}
    assert parts[1]["generations"] == {"b": 1} and parts[1]["personal"] == {"b": {"g": {"w": 5}}}
    assert parts[0]["fit_rounds"] == {"a": {"g": 0}} and parts[1]["kept_round"] == {}
    assert distributed.merge_runtime_states(parts) == state


# Both entry points are rank 0 and start rank 1 with the one launcher (local_ranks.py).
ENTRIES = {"train.py": [str(REPO / "train.py")], "main()": ["-c", "from fl_lightning.cli import main; main()"]}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_killed_rank_stops_the_run_naming_it_and_the_checkpoint_resumes(tmp_path, entry):
    command = ENTRIES[entry]
    args = [*resume_args(tmp_path, "killed", "--federation.rounds=8", "--federation.local_epochs=3",
            "--data.max_samples_per_client=60"), "--federation.workers=2", "--federation.rank_timeout=30"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, *command, *args],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not checkpoint_path(tmp_path / "killed", 1).exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.1)
        children = sorted(int(p) for p in subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split())
        ranks = [p for p in children if b"fl_lightning local rank" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ranks) == 1, children
        os.kill(ranks[-1], signal.SIGKILL)  # rank 1 (spawned last)
        killed_at = time.monotonic()
        err = proc.communicate(timeout=60)[1].decode()
        assert time.monotonic() - killed_at < 60
        assert proc.returncode != 0 and "rank 1" in err, err[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    summary = main([*args[:-2], "--federation.resume=last"])  # one process now
    assert summary["rounds"] == 8


@pytest.mark.parametrize("name", ["dpsgd", "dpfedavg", "dpfedavg_secagg", "dpsgd_dropout"])
def test_the_privacy_callbacks_give_the_one_process_weights_and_epsilon_on_two_ranks(runs, name):
    one, two = runs / "one" / name, runs / "two" / name
    assert describe(two)["sha256"] == describe(one)["sha256"]
    privacy = [json.loads((run / "summary.json").read_text())["privacy"] for run in (one, two)]
    assert privacy[0] == privacy[1] and privacy[0]
    assert [r for r in csv.DictReader((one / "rounds.csv").open()) if "privacy" in str(r)]


def test_dp_sgd_resumed_on_two_ranks_reports_the_uninterrupted_epsilon_and_weights(runs):
    # With dropout: failed before, when the Poisson loader's iterators drew from torch's global generator.
    resumed, uninterrupted = runs / "dpsgd-one-two", runs / "one" / "dpsgd_dropout"
    assert describe(resumed)["sha256"] == describe(uninterrupted)["sha256"]
    summaries = [json.loads((run / "summary.json").read_text()) for run in (resumed, uninterrupted)]
    assert summaries[0]["privacy"] == summaries[1]["privacy"]


@pytest.mark.parametrize("name", list(SECAGG_RUNS))
def test_secure_aggregation_on_two_ranks_gives_the_one_process_weights_bit_for_bit(runs, name):
    # Different keys, hence different masks, in every run: equal weights show the masks cancelled exactly.
    one, two = runs / "one" / name, runs / "two" / name
    assert describe(two)["sha256"] == describe(one)["sha256"]
    summaries = [json.loads((run / "summary.json").read_text()) for run in (one, two)]
    assert summaries[0]["secure_aggregation"] == summaries[1]["secure_aggregation"]
    assert {"bits": 32, "clients_with_keys": 5}.items() <= summaries[0]["secure_aggregation"].items()
