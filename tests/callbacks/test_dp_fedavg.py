"""DP-FedAvg in full federations: FedAvg when σ = 0 and C = ∞, clipping, noise, accounting, budgets, resume, wire."""

import math
import shutil

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant

from callbacks import DPFedAvg
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.dp_fedavg import noise_seed
from fl_lightning.outputs.checkpoint import checkpoint_path
from tests.conftest import build_federation

GROUP = {"norm": "group"}  # BatchNorm's running statistics are refused (they would leave the sites unprotected)


def run(tmp_path, callbacks, name="run", rounds=2, model_kwargs=None, **config):
    fed = build_federation(
        tmp_path, callbacks, rounds=rounds, aggregation="uniform", run_name=name,
        model_kwargs={**GROUP, **(model_kwargs or {})}, **config,
    )  # fmt: skip
    return fed, fed.run()


def dp(fed):
    return next(cb for cb in fed.callbacks if isinstance(cb, DPFedAvg))


def delta_norm(state, base, keys):
    return math.sqrt(sum(float((state[k].double() - base[k].double()).pow(2).sum()) for k in keys))


def test_no_noise_and_no_clipping_is_fedavg_bit_for_bit(tmp_path):
    plain, _ = run(tmp_path, [], "fedavg", rounds=3, clients_per_round=2)
    private, summary = run(
        tmp_path, [DPFedAvg(noise_multiplier=0.0, clip_norm=None)], "dp", rounds=3, clients_per_round=2
    )
    for k, v in plain.groups[0].state.items():
        assert torch.equal(private.groups[0].state[k], v), k
    assert summary["privacy"]["epsilon"] is None  # ε = ∞ (no noise), written as null in strict JSON
    noised, _ = run(tmp_path, [DPFedAvg(noise_multiplier=0.1, clip_norm=10.0)], "noised", rounds=3, clients_per_round=2)
    assert any(not torch.equal(noised.groups[0].state[k], v) for k, v in plain.groups[0].state.items())


class Spy(DPFedAvg):
    """Records what the server receives: every reply's ‖Δ‖ and, on the client side, the unclipped norms."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sent, self.trained = [], []

    def on_client_end(self, ctx, module, reply):
        self.trained.append((ctx.round, delta_norm(reply.state, ctx.received, self._client_names)))
        super().on_client_end(ctx, module, reply)

    def on_reply(self, server, task, reply, weight):
        self.sent.append((task.round, delta_norm(reply.state, task.state, self._names)))
        super().on_reply(server, task, reply, weight)


def test_updates_above_the_bound_arrive_scaled_to_it(tmp_path):
    spy = Spy(noise_multiplier=0.0, clip_norm=0.05)
    run(tmp_path, [spy])
    assert all(n > 0.05 for _, n in spy.trained)  # the bound binds for every client
    np.testing.assert_allclose([n for _, n in spy.sent], 0.05, rtol=1e-5)


@pytest.mark.parametrize("noise", ["central", "distributed"])
def test_the_noise_on_the_global_model_has_std_sigma_c_over_m(tmp_path, noise):
    """With lr ≈ 0 nothing trains: the new global model minus the old one is the noise alone, std σ_Δ C / m."""
    sigma, clip, m = 2.0, 0.3, 3
    fed, _ = run(tmp_path, [DPFedAvg(noise_multiplier=sigma, clip_norm=clip, noise=noise)], rounds=1,
                 model_kwargs={"lr": 1e-12})  # fmt: skip
    init = build_federation(tmp_path / "init", model_kwargs=GROUP).module.state_dict()
    diff = torch.cat([(fed.groups[0].state[k] - init[k]).flatten().double() for k in dp(fed)._names])
    n, want = diff.numel(), sigma * clip / m
    assert n > 500
    assert abs(diff.std().item() - want) < 5 * want / math.sqrt(2 * n), (diff.std().item(), want)


def test_adaptive_clipping_follows_the_reference_over_rounds(tmp_path):
    """C of every round against Andrew et al.'s update written in NumPy from the clients' unclipped norms."""
    m, sigma_b, gamma, lr, c0, rounds = 3, 0.6, 0.5, 0.5, 0.02, 4
    spy = Spy(noise_multiplier=1.0, clip_norm=c0, adaptive_clipping=True, target_quantile=gamma, clip_lr=lr,
              clip_count_stddev=sigma_b)  # fmt: skip
    fed, summary = run(tmp_path, [spy], rounds=rounds)
    c, want = c0, []
    for t in range(rounds):
        want.append(c)
        bits = np.array([n <= c for r, n in spy.trained if r == t], dtype=np.float64)
        g = torch.Generator().manual_seed(noise_seed(0, t, "server", "count"))
        z = sigma_b * float(torch.randn((), generator=g, dtype=torch.float64))
        b_bar = np.clip((np.sum(bits - 0.5) + z) / m + 0.5, 0.0, 1.0)  # clipped to [0, 1], as TF Privacy does
        c = c * np.exp(-lr * (b_bar - gamma))
    np.testing.assert_allclose([row["privacy/clip_norm"] for row in fed.run_dir.round_rows], want, rtol=1e-10)
    assert math.isclose(summary["privacy"]["final_clip_norm"], c, rel_tol=1e-10)
    np.testing.assert_allclose([n for r, n in spy.sent if r == rounds - 1], 0, atol=want[-1] * (1 + 1e-5))
    assert math.isclose(summary["privacy"]["update_noise_multiplier"], (1.0 - (2 * sigma_b) ** -2) ** -0.5)
    accountant = RDPAccountant()  # the round's two queries compose to σ = 1: that is what is accounted
    accountant.history = [(1.0, 1.0, rounds)]
    assert summary["privacy"]["epsilon"] == accountant.get_epsilon(1 / 30)


def test_epsilon_per_round_is_the_standalone_accountants(tmp_path):
    sigma, rounds, n, k = 1.5, 3, 3, 2
    fed, summary = run(tmp_path, [DPFedAvg(noise_multiplier=sigma, clip_norm=1.0)], rounds=rounds, clients_per_round=k)
    accountant, delta = RDPAccountant(), 1 / (10 * n)
    want = []
    for _ in range(rounds):
        accountant.step(noise_multiplier=sigma, sample_rate=k / n)
        want.append(accountant.get_epsilon(delta))
    assert [row["privacy/epsilon"] for row in fed.run_dir.round_rows] == want
    p = summary["privacy"]
    assert (p["epsilon"], p["delta"], p["sample_rate"], p["noise_multiplier"]) == (want[-1], delta, k / n, sigma)
    assert "privacy/epsilon" in (tmp_path / "run" / "rounds.csv").read_text().splitlines()[0]


def test_target_epsilon_calibrates_sigma_for_the_planned_rounds(tmp_path):
    fed, summary = run(tmp_path, [DPFedAvg(target_epsilon=20.0, clip_norm=1.0)], rounds=3)
    assert 0.99 * 20.0 <= summary["privacy"]["epsilon"] <= 20.0
    assert summary["privacy"]["rounds_accounted"] == 3


def test_max_epsilon_stops_before_the_round_that_would_pass_it(tmp_path):
    sigma, delta = 1.0, 0.01
    eps = [RDPAccountant() for _ in range(4)]
    for t, acc in enumerate(eps):
        acc.history = [(sigma, 1.0, t + 1)]
    budget = (eps[1].get_epsilon(delta) + eps[2].get_epsilon(delta)) / 2  # between ε after rounds 2 and 3
    with pytest.warns(UserWarning, match=r"stopped before round 3: .*past max_epsilon"):
        fed, summary = run(tmp_path, [DPFedAvg(noise_multiplier=sigma, delta=delta, max_epsilon=budget)], rounds=4)
    assert fed.round == 2 and summary["rounds"] == 2 and len(fed.run_dir.round_rows) == 2
    assert summary["privacy"]["epsilon"] <= budget and "stopped before round 3" in summary["stopped"]
    assert checkpoint_path(tmp_path / "run", 2).is_file() and summary["summary"]  # evaluated, checkpointed
    with pytest.raises(ValueError, match="max_epsilon=0.01 is below"):
        run(tmp_path, [DPFedAvg(noise_multiplier=sigma, delta=delta, max_epsilon=0.01)], "tight")


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "clip_norm": 0.0}, "clip_norm"),
        ({"noise_multiplier": 1.0, "clip_norm": -2.0}, "clip_norm"),
        ({"noise_multiplier": 1.0, "target_epsilon": 1.0}, "noise_multiplier and target_epsilon"),
        ({}, "noise_multiplier and target_epsilon"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"noise_multiplier": 1.0, "clip_norm": None}, "clip_norm"),
        ({"noise_multiplier": 1.0, "delta": 1.5}, "delta"),
        ({"noise_multiplier": 1.0, "max_epsilon": 0.0}, "max_epsilon"),
        ({"noise_multiplier": 1.0, "noise": "local"}, "noise"),
        ({"noise_multiplier": 1.0, "target_quantile": 1.5}, "target_quantile"),
        ({"noise_multiplier": 1.0, "clip_lr": 0.0}, "clip_lr"),
        ({"noise_multiplier": 0.0, "clip_norm": None, "adaptive_clipping": True}, "adaptive_clipping"),
    ],
)
def test_bad_parameters_are_refused_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        DPFedAvg(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "config", "model", "match"),
    [
        ({"noise_multiplier": 1.0, "delta": 0.5}, {}, GROUP, r"delta=0.5 must be below 1/N"),
        ({"noise_multiplier": 1.0}, {"aggregation": "samples"}, GROUP, "federation.aggregation=uniform"),
        ({"noise_multiplier": 1.0}, {}, {"norm": "batch"}, "model.norm=group"),
        ({"noise_multiplier": 1.0, "adaptive_clipping": True, "clip_count_stddev": 0.4}, {}, GROUP,
         "clip_count_stddev=0.4 must exceed"),
    ],
)  # fmt: skip
def test_settings_that_depend_on_the_federation_are_refused_before_training(tmp_path, kwargs, config, model, match):
    fed = build_federation(tmp_path, [DPFedAvg(**kwargs)], **{"aggregation": "uniform", **config}, model_kwargs=model)
    with pytest.raises((ValueError, PreconditionError), match=match):
        fed.run()
    assert not fed.run_dir.round_rows


def test_resume_gives_the_uninterrupted_epsilon_and_weights(tmp_path):
    def callbacks():
        return [DPFedAvg(noise_multiplier=1.0, clip_norm=0.05, adaptive_clipping=True, clip_count_stddev=1.0)]

    full, summary = run(tmp_path, callbacks(), "full", rounds=3, keep_checkpoints=0, clients_per_round=2)
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    torch.manual_seed(1234)
    resumed, again = run(tmp_path, callbacks(), "resumed", rounds=3, clients_per_round=2,
                         resume=str(checkpoint_path(tmp_path / "resumed", 1)))  # fmt: skip
    for k, v in full.groups[0].state.items():
        assert torch.equal(resumed.groups[0].state[k], v), k
    assert again["privacy"] == summary["privacy"]
    assert [r["privacy/epsilon"] for r in resumed.run_dir.round_rows] == [
        r["privacy/epsilon"] for r in full.run_dir.round_rows
    ]


@pytest.mark.parametrize("noise", ["central", "distributed"])
def test_the_serialized_transport_gives_the_inprocess_result(tmp_path, noise):
    def callbacks():
        return [DPFedAvg(noise_multiplier=1.0, clip_norm=0.05, noise=noise, adaptive_clipping=True,
                         clip_count_stddev=1.0)]  # fmt: skip

    direct, a = run(tmp_path, callbacks(), "direct", clients_per_round=2)
    wire, b = run(tmp_path, callbacks(), "wire", clients_per_round=2, transport="serialized")
    for k, v in direct.groups[0].state.items():
        assert torch.equal(wire.groups[0].state[k], v), k
    assert a["privacy"] == b["privacy"]


def test_a_target_epsilon_run_is_not_extended_on_resume(tmp_path):
    """σ calibrated for 2 rounds would end above the target after 3: the resume is refused, naming both numbers."""

    def callbacks():
        return [DPFedAvg(target_epsilon=50.0, clip_norm=1.0)]

    run(tmp_path, callbacks(), "planned", rounds=2, keep_checkpoints=0, clients_per_round=2)
    shutil.copytree(tmp_path / "planned", tmp_path / "longer")
    with pytest.raises(ValueError, match=r"target_epsilon=50.0: .*federation.rounds=3, which would end at ε=") as err:
        run(tmp_path, callbacks(), "longer", rounds=3, clients_per_round=2,
            resume=str(checkpoint_path(tmp_path / "longer", 1)))  # fmt: skip
    assert float(str(err.value).split("end at ε=")[1].split(";")[0]) > 50.0
    _, same = run(tmp_path, callbacks(), "planned", rounds=2, clients_per_round=2,
                  resume=str(checkpoint_path(tmp_path / "planned", 1)))  # fmt: skip
    assert same["privacy"]["epsilon"] <= 50.0  # the planned rounds resume as before


def test_a_planned_epsilon_above_10_is_warned_at_the_start_and_opacus_smallest_alpha_warning_is_explained(tmp_path):
    """Failed before: σ = 0.05 ended at ε in the thousands with only Opacus' unexplained smallest-alpha warning."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fed, summary = run(tmp_path, [DPFedAvg(noise_multiplier=0.05, clip_norm=1.0)], rounds=2)
    messages = [str(w.message) for w in caught]
    eps = summary["privacy"]["epsilon"]
    assert eps > 10
    (start,) = [m for m in messages if m.startswith("DPFedAvg: the planned 2 rounds at σ=0.05")]
    assert f"reaches ε = {eps:.4g}" in start and "above 10" in start and "Choosing σ, C" in start
    assert not any("Optimal order is the smallest alpha" in m for m in messages)


def test_a_small_planned_epsilon_or_a_max_epsilon_within_10_is_not_warned(tmp_path):
    import warnings

    for name, cb in (("small", DPFedAvg(noise_multiplier=5.0, clip_norm=1.0)),
                     ("capped", DPFedAvg(noise_multiplier=0.05, clip_norm=1.0, max_epsilon=10.0))):  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                run(tmp_path, [cb], name=name, rounds=2)
            except ValueError:
                pass  # max_epsilon below one round's ε is refused before training: not a large-ε warning either
        assert not any("above 10" in str(w.message) for w in caught), name
