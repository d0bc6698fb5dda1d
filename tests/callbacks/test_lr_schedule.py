"""LRSchedule: the per-round factor by hand, the learning rate each fit really uses, splits, kept state, SCAFFOLD."""

import math

import pytest
import torch

from callbacks import ClusteredFL, FederatedCallback, LRSchedule, Scaffold
from fl_lightning.clients import ClassificationClient, SegmentationClient
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.lr_schedule import lr_factor
from tests.conftest import build_federation, reference_scaffold, tiny_data

LR = 0.1

# ---------------------------------------------------------------- the pure function

ROUNDS = [0, 1, 2, 5, 9, 10, 19]


@pytest.mark.parametrize(
    ("kind", "kwargs", "expected"),
    [
        ("constant", {}, lambda r, R: 1.0),
        ("exponential", {"gamma": 0.9}, lambda r, R: 0.9**r),
        ("step", {"gamma": 0.5, "step_size": 5}, lambda r, R: 0.5 ** (r // 5)),
        ("cosine", {}, lambda r, R: 0.5 * (1 + math.cos(math.pi * r / R))),
        ("cosine", {"min_factor": 0.1}, lambda r, R: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * r / R))),
        ("poly", {"power": 2.0}, lambda r, R: (1 - r / R) ** 2),
        ("poly", {"power": 0.9, "min_factor": 0.3}, lambda r, R: max((1 - r / R) ** 0.9, 0.3)),
        ("exponential", {"gamma": 0.5, "min_factor": 0.01}, lambda r, R: max(0.5**r, 0.01)),
    ],
)
def test_factor_matches_the_formula(kind, kwargs, expected):
    got = [lr_factor(kind, r, 20, **kwargs) for r in ROUNDS]
    assert got == pytest.approx([expected(r, 20) for r in ROUNDS], rel=1e-12, abs=0)
    assert got[0] == 1.0 and all(0 < f <= 1 for f in got)


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        (("linear", 0, 10), {}, "kind"),
        (("exponential", 0, 10), {"gamma": 0.0}, "gamma"),
        (("exponential", 0, 10), {"gamma": -0.5}, "gamma"),
        (("exponential", 0, 10), {"gamma": 1.5}, "gamma"),
        (("step", 0, 10), {"step_size": 0}, "step_size"),
        (("step", 0, 10), {"step_size": 2.5}, "step_size"),
        (("poly", 0, 10), {"power": 0.0}, "power"),
        (("cosine", 0, 10), {"min_factor": -0.1}, "min_factor"),
        (("cosine", 0, 10), {"min_factor": 1.5}, "min_factor"),
        (("cosine", 0, 0), {}, "total_rounds"),
        (("cosine", -1, 10), {}, "round_idx"),
        (("cosine", 10, 10), {}, "round_idx"),
    ],
)
def test_bad_arguments_are_named(args, kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        lr_factor(*args, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"kind": "linear"}, "kind"), ({"gamma": 0}, "gamma"), ({"step_size": 0}, "step_size"), ({"power": -1}, "power")],
)
def test_callback_validates_in_its_constructor(kwargs, name):
    with pytest.raises(ValueError, match=rf"LRSchedule {name} must"):
        LRSchedule(**kwargs)


# ---------------------------------------------------------------- the learning rate each fit uses


@pytest.mark.parametrize(
    "make",
    [
        lambda: ClassificationClient(image_size=(8, 8), width=4, optimizer="sgd", lr=0.2),
        lambda: SegmentationClient(image_size=(8, 8), width=2, depth=1, optimizer="adam", lr=0.2),
    ],
    ids=["classification", "segmentation"],
)
def test_client_modules_build_their_optimiser_with_the_factor(make):
    module = make()
    assert module.lr_factor == 1.0 and module.configure_optimizers().param_groups[0]["lr"] == 0.2
    module.lr_factor = 0.25
    assert module.configure_optimizers().param_groups[0]["lr"] == pytest.approx(0.05, rel=1e-12)


class LRRecorder(FederatedCallback):
    """Records the optimiser's learning rate at every training batch, keyed by (round, group, client)."""

    def __init__(self):
        self.lrs = {}
        self._key = None

    def on_client_start(self, ctx, module):
        client_id = ctx.client_id
        self._key = (ctx.round, ctx.group, client_id)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.setdefault(self._key, []).append(trainer.optimizers[0].param_groups[0]["lr"])


def assert_scheduled(recorder, rounds, expected_factor, num_clients=3):
    assert {r for r, _, _ in recorder.lrs} == set(range(rounds))
    assert len(recorder.lrs) == rounds * num_clients
    for (r, _, cid), lrs in recorder.lrs.items():
        assert lrs and all(lr == pytest.approx(LR * expected_factor(r), rel=1e-12, abs=0) for lr in lrs), (r, cid)


def test_every_fit_trains_with_the_rounds_learning_rate(tmp_path):
    recorder = LRRecorder()
    fed = build_federation(tmp_path, [LRSchedule(kind="exponential", gamma=0.5), recorder], rounds=3)
    fed.run()
    assert_scheduled(recorder, 3, lambda r: 0.5**r)
    assert fed.module.lr_factor == 0.25  # set by the last round's clients


def test_kept_optimizer_state_does_not_bring_back_an_old_learning_rate(tmp_path):
    recorder = LRRecorder()
    fed = build_federation(
        tmp_path,
        [LRSchedule(kind="step", gamma=0.5, step_size=1), recorder],
        rounds=3,
        keep_optimizer_state=True,
        model_kwargs={"momentum": 0.9},
    )
    fed.run()
    assert_scheduled(recorder, 3, lambda r: 0.5**r)
    # the momentum buffers really were kept (and restored: each client's state is from its last fit)
    states = list(fed.transport.optimizer_states.values())
    assert len(states) == 3 and all(s["state"] and "momentum_buffer" in s["state"][0] for s in states)
    assert all(s["param_groups"][0]["lr"] == pytest.approx(LR * 0.25) for s in states)


def test_constant_schedule_is_bit_identical_to_no_schedule(tmp_path):
    kwargs = {"rounds": 2, "keep_optimizer_state": True, "model_kwargs": {"momentum": 0.9}}
    plain = build_federation(tmp_path / "a", **kwargs)
    constant = build_federation(tmp_path / "b", [LRSchedule(kind="constant")], **kwargs)
    plain.run(), constant.run()
    a, b = plain.groups[0].state, constant.groups[0].state
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_decay_continues_across_a_split(tmp_path):
    data = tiny_data(num_clients=4, site_styles=False)
    for cid in ("site2", "site3"):  # a second population: CFL splits it off
        split = data.client_data(cid)
        split.train_y.copy_(9 - split.train_y)
    recorder = LRRecorder()
    cfl = ClusteredFL(split_round=2)
    fed = build_federation(tmp_path, [cfl, LRSchedule(kind="exponential", gamma=0.5), recorder], data=data, rounds=4)
    fed.run()
    assert cfl.splits and len(fed.groups) == 2
    groups_by_round = {r: {g for rr, g, _ in recorder.lrs if rr == r} for r in range(4)}
    assert groups_by_round[1] == {"global"} and groups_by_round[2] == {g.name for g in fed.groups}
    assert_scheduled(recorder, 4, lambda r: 0.5**r, num_clients=4)  # round 2 is at 0.25, not back at 1


class Interrupted(RuntimeError):
    pass


class StopAt(FederatedCallback):
    """Interrupts the run when round ``at`` would start (after the previous round's checkpoint)."""

    def __init__(self, at=None):
        self.at = at

    def on_round_start(self, federation, round_idx, selected):
        if round_idx == self.at:
            raise Interrupted(round_idx)


def test_resume_continues_the_schedule_exactly(tmp_path):
    def run(stop_at=None, **kwargs):
        recorder = LRRecorder()
        callbacks = [LRSchedule(kind="poly", power=2.0), recorder, StopAt(stop_at)]  # poly: depends on R as well
        fed = build_federation(tmp_path, callbacks, rounds=4, **kwargs)
        fed.run()
        return fed, recorder

    full, full_lrs = run(run_name="full")
    with pytest.raises(Interrupted):
        run(stop_at=2, run_name="part")
    resumed, resumed_lrs = run(run_name="part", resume="last")
    assert {r for r, _, _ in resumed_lrs.lrs} == {2, 3}
    assert all(resumed_lrs.lrs[k] == full_lrs.lrs[k] for k in resumed_lrs.lrs)
    a, b = full.groups[0].state, resumed.groups[0].state
    assert all(torch.equal(a[k], b[k]) for k in a)


class IgnoresFactor(ClassificationClient):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_a_module_that_ignores_the_factor_is_refused(tmp_path):
    data = tiny_data()
    model = IgnoresFactor(num_classes=10, in_channels=1, image_size=data.image_size, width=4, momentum=0.0)
    fed = build_federation(tmp_path, [LRSchedule()], data=data, model=model)
    with pytest.raises(PreconditionError, match="ignores lr_factor"):
        fed.run()


# ---------------------------------------------------------------- SCAFFOLD under a schedule


@pytest.mark.parametrize("keep_optimizer_state", [False, True], ids=["fresh", "kept"])
def test_scaffold_control_variates_use_the_scheduled_learning_rate(tmp_path, keep_optimizer_state):
    scaffold = Scaffold()
    fed = build_federation(
        tmp_path,
        [scaffold, LRSchedule(kind="exponential", gamma=0.5)],
        rounds=3,
        clients_per_round=2,
        keep_optimizer_state=keep_optimizer_state,
    )
    fed.run()
    lrs = [LR * 0.5**r for r in range(3)]
    w, c = reference_scaffold(3, 2, lrs)
    keys = [k for k in w if k.startswith("net.") and w[k].is_floating_point()]
    for k in keys:
        torch.testing.assert_close(fed.groups[0].state[k], w[k], rtol=0, atol=1e-5, msg=k)
    for k in c:
        torch.testing.assert_close(scaffold.c[k], c[k], rtol=0, atol=1e-4, msg=k)
    # the same training with η = model.lr in the control update would give clearly different controls
    _, c_wrong_eta = reference_scaffold(3, 2, lrs, control_lrs=[LR] * 3)
    assert any((scaffold.c[k] - c_wrong_eta[k]).abs().max() > 1e-2 for k in c)
