"""DP-SGD (callbacks.DPSGD) against a plain-PyTorch per-example reference, Opacus' accountant, and its contract."""

import json
import math
import re
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import create_accountant
from torch import nn

from callbacks import DPSGD, FederatedCallback, FedProx
from callbacks.dp_sgd import noise_seed, poisson_seed
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.dp_sgd import add_steps, epsilon
from fl_lightning.outputs.checkpoint import checkpoint_path
from fl_lightning.server.selection import select_clients
from tests.conftest import build_federation, tiny_data, tiny_model

LR, SIGMA, CLIP = 0.1, 0.7, 0.5


def federation(tmp_path, callbacks, norm="group", **config):
    data = tiny_data()
    return build_federation(tmp_path, callbacks, data=data, model=tiny_model(data, norm=norm), **config)


def reference_dp_step(cid: str, poisson: bool) -> dict[str, torch.Tensor]:
    """One DP-SGD step written out: per-example gradients by a loop, clip to C, sum, + N(0, σ²C²), / B, SGD step."""
    data = tiny_data()
    module = tiny_model(data, norm="group").train()
    batch_size, n = data.batch_size, data.num_train_samples(cid)
    if poisson:  # every example with probability q = B/n, from the generator the callback seeds
        g = torch.Generator().manual_seed(poisson_seed(0, cid, 0))
        split = data.client_data(cid)
        idx = (torch.rand(n, generator=g) < batch_size / n).nonzero().reshape(-1)
        x, y = split.train_x[idx], split.train_y[idx]
    else:
        x, y = next(iter(data.client_train_loader(cid, steps=1)))
    params = list(module.parameters())
    summed = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        grads = torch.autograd.grad(F.cross_entropy(module(x[i : i + 1]), y[i : i + 1]), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, CLIP / (norm.item() + 1e-6))  # Opacus' clip factor (its 1e-6 guards a zero norm)
        for s, g in zip(summed, grads):
            s.add_(g, alpha=factor)
    noise_gen = torch.Generator().manual_seed(noise_seed(0, cid, 0))
    with torch.no_grad():
        for p, s in zip(params, summed):
            noise = torch.normal(0, SIGMA * CLIP, size=p.shape, generator=noise_gen)
            p.sub_(LR * (s + noise) / batch_size)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("poisson", [False, True])
def test_one_step_equals_the_per_example_reference(tmp_path, poisson):
    cb = DPSGD(noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson=poisson)
    fed = federation(tmp_path, [cb], rounds=1, local_steps=1, aggregation="uniform", model_kwargs={"lr": LR})
    fed.run()
    refs = [reference_dp_step(cid, poisson) for cid in fed.data.client_ids]
    for k, v in fed.groups[0].state.items():
        if v.is_floating_point():
            want = sum(r[k].double() for r in refs) / len(refs)
            torch.testing.assert_close(v.double(), want, atol=1e-6, rtol=1e-5, msg=k)


@pytest.mark.parametrize("accountant", ["rdp", "gdp"])
def test_epsilon_equals_a_standalone_opacus_accountant(tmp_path, accountant):
    rounds, per_round = 3, 2
    fed = federation(tmp_path, [DPSGD(noise_multiplier=1.1, accountant=accountant)], rounds=rounds,
                     clients_per_round=per_round)  # fmt: skip
    summary = fed.run()
    ids = fed.data.client_ids
    fits = {c: sum(c in select_clients(ids, r, seed=0, k=per_round) for r in range(rounds)) for c in ids}
    want = {}
    for cid, count in fits.items():
        if not count:
            continue
        n = fed.data.num_train_samples(cid)
        acc = create_accountant(mechanism=accountant)
        for _ in range(count * math.ceil(n / fed.data.batch_size)):  # steps: the plain loader's batches per fit
            acc.step(noise_multiplier=1.1, sample_rate=fed.data.batch_size / n)
        want[cid] = acc.get_epsilon(delta=0.1 / n)
    assert summary["privacy"]["epsilon"] == pytest.approx(want, rel=1e-9)
    last = fed.run_dir.round_rows[-1]
    assert last["privacy/epsilon_worst"] == pytest.approx(max(want.values()), rel=1e-9)
    assert last["privacy/epsilon_mean"] == pytest.approx(sum(want.values()) / len(want), rel=1e-9)


def test_target_epsilon_calibrates_sigma_for_the_planned_rounds(tmp_path):
    summary = federation(tmp_path, [DPSGD(target_epsilon=3.0)], rounds=2).run()
    assert all(2.9 <= e <= 3.0 for e in summary["privacy"]["epsilon"].values()), summary["privacy"]


def test_no_noise_and_no_clipping_equals_the_run_without_the_callback_bit_for_bit(tmp_path):
    """σ = 0, C = ∞, fixed batches: plain SGD (ε = ∞), so FedAvg's weights bit for bit and the steps still counted."""
    plain = federation(tmp_path / "plain", [], rounds=2)
    plain.run()
    cb = DPSGD(noise_multiplier=0.0, max_grad_norm=math.inf, poisson=False)
    dp = federation(tmp_path / "dp", [cb], rounds=2)
    dp.run()
    for k, v in plain.groups[0].state.items():
        assert torch.equal(dp.groups[0].state[k], v), k
    assert dp.run_dir.round_rows[-1]["privacy/epsilon_worst"] == math.inf
    taken: dict[str, int] = {}
    for row in dp.run_dir.client_rows:
        if row.get("train_steps"):
            taken[row["client"]] = taken.get(row["client"], 0) + int(row["train_steps"])
    summary = json.loads((dp.run_dir.path / "summary.json").read_text())
    assert summary["privacy"]["steps"] == taken and sum(taken.values()) > 0


def test_opacus_without_noise_and_with_a_bound_no_gradient_reaches_equals_the_run_without_it(tmp_path):
    """σ = 0 and C = 1e30 through Opacus: FedAvg's weights to 1e-6, not bit for bit.

    Opacus sums per-example gradients (an einsum over the batch) and divides by B; autograd reduces the batch
    inside each layer's backward (a matmul over the batch dimension): the same sum in another order.
    """
    plain = federation(tmp_path / "plain", [], rounds=2)
    plain.run()
    dp = federation(tmp_path / "dp", [DPSGD(noise_multiplier=0.0, max_grad_norm=1e30, poisson=False)], rounds=2)
    dp.run()
    for k, v in plain.groups[0].state.items():
        torch.testing.assert_close(dp.groups[0].state[k], v, atol=1e-6, rtol=0, msg=k)
    assert not all(torch.equal(dp.groups[0].state[k], v) for k, v in plain.groups[0].state.items())


def test_nothing_of_opacus_stays_on_the_module_or_trainer_after_a_fit(tmp_path):
    fed = federation(tmp_path, [DPSGD(noise_multiplier=1.0)], rounds=1)
    fed.run()
    module = fed.module
    assert all(not m._forward_hooks and not m._backward_hooks for m in module.modules())
    assert not hasattr(module, "autograd_grad_sample_hooks")
    leftovers = ("grad_sample", "summed_grad", "_forward_counter", "_current_grad_sample")
    assert not [n for n, p in module.named_parameters() if any(hasattr(p, a) for a in leftovers)]
    assert all(m.inplace for m in module.modules() if isinstance(m, torch.nn.ReLU))
    assert type(fed.trainer.strategy.optimizers[0]).__module__.startswith("torch.optim")


@pytest.mark.parametrize("dropout", [False, True])
def test_a_resumed_run_reports_the_same_epsilon_and_weights(tmp_path, dropout):
    """A fresh process resumed after round 2 ends with the uninterrupted run's weights and ε.

    With dropout this failed before: the Poisson loader's iterators drew their base seed from torch's global
    generator, and Lightning makes one iterator on a Trainer's first fit but two on later ones, so the resumed
    process was one draw behind and every dropout mask after it differed.
    """

    def build(name, **kw):
        data = tiny_data()
        model = tiny_model(data, norm="group")
        if dropout:
            model.net.classifier = nn.Sequential(nn.Dropout(0.5), model.net.classifier)
        cb = DPSGD(noise_multiplier=1.0)
        return build_federation(
            tmp_path, [cb], data=data, model=model, rounds=4, keep_checkpoints=0, run_name=name, **kw
        )

    full = build("full")
    want = full.run()
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    torch.manual_seed(1234)  # the resumed run's randomness must come from the checkpoint and the seeds only
    resumed = build("resumed", resume=str(checkpoint_path(tmp_path / "resumed", 2)))
    got = resumed.run()
    for k, v in full.groups[0].state.items():
        assert torch.equal(v, resumed.groups[0].state[k]), k
    assert got["privacy"] == want["privacy"]
    assert (
        full.run_dir.round_rows[-1]["privacy/epsilon_worst"] == resumed.run_dir.round_rows[-1]["privacy/epsilon_worst"]
    )


def test_serialized_transport_equals_inprocess(tmp_path):
    runs = {}
    for transport in ("inprocess", "serialized"):
        fed = federation(tmp_path / transport, [DPSGD(noise_multiplier=1.0)], rounds=2, transport=transport)
        runs[transport] = (fed.run(), fed.groups[0].state)
    for k, v in runs["inprocess"][1].items():
        assert torch.equal(v, runs["serialized"][1][k]), k
    assert runs["inprocess"][0]["privacy"] == runs["serialized"][0]["privacy"]


def test_batch_norm_is_refused_with_the_layer_and_the_fix(tmp_path):
    with pytest.raises(PreconditionError, match=r"net\.features\.1.*model\.norm=group"):
        federation(tmp_path / "a", [DPSGD(noise_multiplier=1.0)], norm="batch", rounds=1).run()
    fed = federation(tmp_path / "b", [DPSGD(noise_multiplier=1.0, fix_model=True)], norm="batch", rounds=1)
    fed.run()
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fed.module.modules())
    assert any(isinstance(m, torch.nn.GroupNorm) for m in fed.module.modules())


def test_a_client_past_its_budget_is_left_out_and_named(tmp_path):
    ids, data = tiny_data().client_ids, tiny_data()
    n, batch = data.num_train_samples(ids[0]), data.batch_size
    eps = [epsilon(add_steps([], 1.0, batch / n, k * math.ceil(n / batch)), 0.1 / n) for k in (2, 3)]
    cb = DPSGD(noise_multiplier=1.0, max_epsilon=sum(eps) / 2)  # room for two fits, not three
    selections = [select_clients(ids, r, seed=0, k=2) for r in range(3)]
    # the seeded selection: site1 and site2 train in rounds 1 and 2; in round 3 site1 would fit a third time
    assert selections == [["site1", "site2"], ["site1", "site2"], ["site0", "site1"]]
    fed = federation(tmp_path, [cb], rounds=3, clients_per_round=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = fed.run()
    messages = [str(w.message) for w in caught]
    assert any(re.search(r"client 'site1' failed.*PrivacyBudgetExhausted.*max_epsilon", m) for m in messages)
    for cid in ("site1", "site2"):  # said when the budget runs out, before the round that leaves the client out
        assert any(m.startswith(f"DPSGD: client '{cid}' reached ε=") and "will not train again" in m for m in messages)
    assert [row["round/failed_clients"] for row in fed.run_dir.round_rows] == [0, 0, 1]
    assert fed.run_dir.round_rows[-1]["privacy/exhausted_clients"] == 2
    assert summary["privacy"]["exhausted"] == ["site1", "site2"]
    assert summary["privacy"]["epsilon"]["site1"] == pytest.approx(eps[0])
    assert max(summary["privacy"]["epsilon"].values()) <= cb.max_epsilon  # never past the budget
    assert summary["privacy"]["steps"]["site0"] == math.ceil(n / batch)  # the fresh client trained


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "target_epsilon": 1.0}, "target_epsilon"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"noise_multiplier": 1.0, "max_grad_norm": 0.0}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "max_grad_norm": math.inf}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "delta": 1.5}, "delta"),
        ({"noise_multiplier": 1.0, "accountant": "moments"}, "accountant"),
        ({"noise_multiplier": 1.0, "max_epsilon": -1.0}, "max_epsilon"),
    ],
)
def test_bad_parameters_are_refused_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        DPSGD(**kwargs)


def test_a_delta_not_below_one_over_n_and_gradient_editors_are_refused_before_training(tmp_path):
    with pytest.raises(PreconditionError, match=r"delta=0\.05 .*n=32"):
        federation(tmp_path / "a", [DPSGD(noise_multiplier=1.0, delta=0.05)], rounds=1).run()
    with pytest.raises(PreconditionError, match="FedProx"):
        federation(tmp_path / "b", [DPSGD(noise_multiplier=1.0), FedProx(mu=0.1)], rounds=1).run()

    class Replay(FederatedCallback):
        def wrap_train_loader(self, ctx, loader):
            return loader

    with pytest.raises(PreconditionError, match=r"\['Replay'\].*training loader"):
        federation(tmp_path / "c", [DPSGD(noise_multiplier=1.0), Replay()], rounds=1).run()


def test_history_merges_like_opacus_and_noise_free_steps_have_no_guarantee():
    assert add_steps(add_steps([], 1.0, 0.25, 4), 1.0, 0.25, 4) == [(1.0, 0.25, 8)]
    assert add_steps([(1.0, 0.25, 4)], 2.0, 0.25, 1) == [(1.0, 0.25, 4), (2.0, 0.25, 1)]
    assert epsilon([], 1e-5) == 0.0 and epsilon([(0.0, 0.1, 3)], 1e-5) == math.inf


def test_a_target_epsilon_run_is_not_extended_on_resume(tmp_path):
    """Each client's σ is calibrated for the planned rounds: a resume asking for more is refused before training."""
    first = federation(tmp_path, [DPSGD(target_epsilon=3.0)], rounds=2, keep_checkpoints=0, run_name="planned")
    first.run()
    shutil.copytree(tmp_path / "planned", tmp_path / "longer")
    longer = federation(tmp_path, [DPSGD(target_epsilon=3.0)], rounds=3, run_name="longer",
                        resume=str(checkpoint_path(tmp_path / "longer", 2)))  # fmt: skip
    with pytest.raises(ValueError, match=r"calibrated for federation.rounds=2; this resume asks for .*rounds=3"):
        longer.run()


def _load_without_plan(self, state_dict):
    DPSGD.load_state_dict(self, {k: v for k, v in state_dict.items() if k != "planned_rounds"})


# DPSGD as a checkpoint from before the server half recorded its planned rounds restores it (same name: the
# checkpoint names its callbacks by class)
PlanlessDPSGD = type("DPSGD", (DPSGD,), {"load_state_dict": _load_without_plan})


def test_a_client_whose_restored_sigma_was_planned_for_fewer_rounds_refuses_to_train(tmp_path):
    federation(tmp_path, [DPSGD(target_epsilon=3.0)], rounds=2, keep_checkpoints=0, run_name="planned").run()
    shutil.copytree(tmp_path / "planned", tmp_path / "old")
    resumed = federation(tmp_path, [PlanlessDPSGD(target_epsilon=3.0)], rounds=4, run_name="old",
                         resume=str(checkpoint_path(tmp_path / "old", 2)))  # fmt: skip
    with pytest.raises(
        PreconditionError,
        match=r"client 'site0': its σ=.* calibrated for fewer rounds than federation"
        r".rounds=4 \(ε would reach ",
    ):
        resumed.run()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_epsilon": 0.0001}, r"target_epsilon=0.0001 cannot be reached by client 'site\d'.*Raise target_eps"),
        ({"noise_multiplier": 1.0, "max_epsilon": 1e-4}, r"max_epsilon=0.0001 is below ε=.* of one fit of client"),
    ],
)
def test_a_budget_no_client_can_meet_is_refused_before_any_step_naming_the_key(tmp_path, kwargs, match):
    """Failed before: Opacus' bare "The privacy budget is too low.", or every client "failed" and round 0 said so."""
    fed = federation(tmp_path, [DPSGD(**kwargs)], rounds=2)
    with pytest.raises(PreconditionError, match=match):
        fed.run()
    assert not fed.run_dir.round_rows  # refused before any round completed


def test_a_client_whose_planned_epsilon_is_above_10_is_warned_once_naming_it(tmp_path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fed = federation(tmp_path, [DPSGD(noise_multiplier=0.3, max_grad_norm=1.0)], rounds=2)
        summary = fed.run()
    large = [str(w.message) for w in caught if "above 10" in str(w.message)]
    assert summary["privacy"]["epsilon_worst"] > 10
    assert len(large) == 1 and large[0].startswith("DPSGD: client 'site0': the planned 2 rounds")
    assert not any("Optimal order is the smallest alpha" in str(w.message) for w in caught)
