"""SecureAggregation: the server sees only masked updates, and their sum is FedAvg's within the quantisation bound."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import callbacks.secure_aggregation as secure_aggregation
from callbacks import DPFedAvg, FedBN, FederatedCallback, FedOpt, Scaffold, SecureAggregation
from callbacks.secure_aggregation import flat_update, masked_names
from fl_lightning.errors import PreconditionError
from fl_lightning.ops import secagg
from fl_lightning.outputs.checkpoint import checkpoint_path
from tests.conftest import build_federation, tiny_data, tiny_model

IDS = ["a", "b", "c", "d"]
BITS = 32


def _keys(ids=IDS):
    private = {c: secagg.generate_private_key() for c in ids}
    return private, {c: secagg.public_key(k) for c, k in private.items()}


def _uploads(values, bits=BITS, round_idx=0):
    private, public = _keys(list(values))
    return {
        c: secagg.masked_upload(
            v, secagg.client_mask(c, private[c], public, v.numel(), "run", round_idx, "global"), bits, len(values)
        )
        for c, v in values.items()
    }


# ---------------------------------------------------------------------------------------------- the maths
def test_pair_keys_agree_and_are_fresh_per_round_and_not_from_any_seed():
    private, public = _keys(["a", "b"])
    info = secagg.pair_info("run", 3, "global", "a", "b")
    assert info == secagg.pair_info("run", 3, "global", "b", "a")
    k_ab = secagg.pair_key(private["a"], public["b"], info)
    assert k_ab == secagg.pair_key(private["b"], public["a"], info)
    assert k_ab != secagg.pair_key(private["a"], public["b"], secagg.pair_info("run", 4, "global", "a", "b"))
    torch.manual_seed(0)
    first = secagg.generate_private_key()
    torch.manual_seed(0)
    assert secagg.generate_private_key() != first  # OS randomness: seeding the run does not reproduce the key


@pytest.mark.parametrize("bits", [16, 32])
def test_masks_cancel_exactly_and_the_sum_is_within_the_quantisation_bound(bits):
    g = torch.Generator().manual_seed(0)
    values = {c: torch.randn(1000, generator=g, dtype=torch.float64) * 0.1 for c in IDS}
    total = secagg.unmasked_sum(_uploads(values, bits).values(), bits)
    exact = sum(values.values())
    assert (total - exact).abs().max() <= len(IDS) * 2.0 ** -(bits + 1)
    quantised = sum(torch.round(v * 2.0**bits) for v in values.values()) / 2.0**bits
    assert torch.equal(total, quantised)  # the masks cancel exactly, modulo 2^64


def test_a_missing_upload_leaves_garbage():
    values = {c: torch.full((100,), 0.01, dtype=torch.float64) for c in IDS}
    uploads = _uploads(values)
    partial = secagg.unmasked_sum([uploads[c] for c in IDS[:-1]], BITS)
    assert (partial - 0.03).abs().min() > 1.0  # why a dropout must never be aggregated silently


def test_one_masked_upload_is_unrelated_to_the_update():
    values = {c: torch.linspace(-0.05, 0.05, 4096, dtype=torch.float64) for c in IDS}
    upload = _uploads(values)["a"]
    plain = torch.round(values["a"] * 2.0**BITS).to(torch.int64)
    assert (upload == plain).sum() == 0
    corr = np.corrcoef(upload.double().numpy(), plain.double().numpy())[0, 1]
    assert abs(corr) < 0.1  # 4096 samples: the std of a null correlation is 1/64
    bits = np.unpackbits(upload.numpy().view(np.uint8)).reshape(-1, 64).mean(axis=0)
    assert np.all(np.abs(bits - 0.5) < 0.05)  # every bit position looks uniform (the top bits of `plain` do not)


def test_an_update_too_large_for_the_fixed_point_is_refused():
    with pytest.raises(OverflowError, match="lower `bits`"):
        secagg.quantize(torch.tensor([2.0**30]), 32, 4)


# ---------------------------------------------------------------------------------------------- the callback
class Spy(FederatedCallback):
    """Records each client's plain upload (client side, before masking) and what the server receives."""

    def __init__(self) -> None:
        super().__init__()
        self.plain: dict[tuple[int, str], torch.Tensor] = {}
        self.received: dict[tuple[int, str], tuple[dict, torch.Tensor]] = {}

    def on_client_end(self, ctx, module, reply):
        weight = ctx.task.payloads["SecureAggregation"]["weight"]
        names = masked_names(ctx.received, ctx.private_keys)
        update = flat_update(reply.state, ctx.received, names) * weight
        self.plain[ctx.round, ctx.client_id] = torch.round(update * 2.0**BITS).to(torch.int64)

    def on_reply(self, server, task, reply, weight):
        self.received[task.round, reply.client_id] = (dict(reply.state), reply.payloads["SecureAggregation"]["masked"])


@pytest.fixture
def allow_spy(monkeypatch):
    monkeypatch.setattr(secure_aggregation, "COMPATIBLE", secure_aggregation.COMPATIBLE | {"Spy"})


def _float_states_close(a, b, atol):
    for k, v in a.items():
        if v.is_floating_point():
            assert torch.allclose(v, b[k], atol=atol, rtol=0), k
        else:
            assert torch.equal(v, b[k]) or k.endswith("num_batches_tracked"), k


EXTRA = {"fedavg": list, "fedopt": lambda: [FedOpt(lr=0.01)], "fedbn": lambda: [FedBN()]}


@pytest.mark.parametrize("extra", list(EXTRA))
def test_one_round_aggregate_equals_the_plain_one(tmp_path, extra):
    """FedAvg (sample weights, BatchNorm statistics masked), FedAdam on the unmasked mean, FedBN's shared part."""
    plain = build_federation(tmp_path, EXTRA[extra](), rounds=1, run_name="plain")
    plain.run()
    init = tiny_model(tiny_data()).state_dict()
    secure = build_federation(tmp_path, [SecureAggregation(bits=BITS), *EXTRA[extra]()], rounds=1, run_name="secure")
    secure.run()
    private = set().union(*(cb.private_keys(secure.module) for cb in secure.callbacks))
    assert bool(private) == (extra == "fedbn")
    shared = {k: v for k, v in secure.groups[0].state.items() if k not in private}
    # m · 2^-(bits+1) of quantisation plus float32 rounding of the plain mean (it accumulates in float32)
    _float_states_close(shared, plain.groups[0].state, atol=3 * 2.0 ** -(BITS + 1) + 1e-6)
    assert max((v - init[k]).abs().max() for k, v in shared.items() if v.is_floating_point()) > 1e-3
    for k, v in secure.groups[0].state.items():
        if k in private or not v.is_floating_point():  # never sent (private) / not aggregated (integer buffers)
            assert torch.equal(v, init[k]), k


def test_the_server_never_receives_an_unmasked_update(tmp_path, allow_spy):
    spy = Spy()
    fed = build_federation(tmp_path, [SecureAggregation(bits=BITS), spy], rounds=2)
    fed.run()
    assert set(spy.received) == set(spy.plain) and len(spy.received) == 2 * 3
    for key, (state, masked) in spy.received.items():
        assert state == {}  # nothing of the model in the clear
        plain = spy.plain[key]
        assert masked.shape == plain.shape
        assert (masked == plain).float().mean() < 1e-3
        assert abs(np.corrcoef(masked.double().numpy(), plain.double().numpy())[0, 1]) < 0.2


def test_dp_fedavg_with_distributed_noise_is_masked_after_clipping(tmp_path):
    """Listed before DPFedAvg, SecureAggregation still masks the clipped, noised update (``on_upload``)."""
    model_kwargs = {"norm": "group"}
    dp = dict(noise_multiplier=0.5, clip_norm=0.5, noise="distributed")
    plain = build_federation(
        tmp_path, [DPFedAvg(**dp)], rounds=2, aggregation="uniform", model_kwargs=model_kwargs, run_name="plain"
    )
    plain.run()
    secure = build_federation(
        tmp_path,
        [SecureAggregation(bits=BITS), DPFedAvg(**dp)],
        rounds=2,
        aggregation="uniform",
        model_kwargs=model_kwargs,
        run_name="secure",
    )
    secure.run()
    _float_states_close(secure.groups[0].state, plain.groups[0].state, atol=1e-5)


def test_methods_that_need_individual_updates_are_refused(tmp_path):
    fed = build_federation(tmp_path, [SecureAggregation(), Scaffold()], model_kwargs={"momentum": 0.0})
    with pytest.raises(PreconditionError, match="Scaffold: its server averages each client's control variate"):
        fed.run()


def test_flowers_secaggplus_is_refused_where_no_transport_runs_it(tmp_path):
    fed = build_federation(tmp_path, [SecureAggregation(scheme="secaggplus")])
    with pytest.raises(PreconditionError, match="Flower engine's SuperNodes"):
        fed.run()
    with pytest.raises(ValueError, match="scheme"):
        SecureAggregation(scheme="secagg")


class FailOn(FederatedCallback):
    """Makes one client's local fit raise in one round (a dropout: the reply carries ``error``)."""

    def __init__(self, client: str, round_idx: int) -> None:
        super().__init__()
        self.target, self.now = (round_idx, client), None

    def on_client_start(self, ctx, module):
        self.now = (ctx.round, ctx.client_id)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.now == self.target:
            raise RuntimeError("injected dropout")


@pytest.mark.parametrize("transport", ["inprocess", "serialized"])
def test_a_dropped_client_is_summed_without_by_fresh_masks_as_plain_fedavg_is(tmp_path, monkeypatch, transport):
    """site1 fails in round 2 (a data problem): the others' masks are drawn again over them alone and the round
    gives FedAvg's renormalised mean without site1, within the quantisation bound; a resume no longer fails it."""
    monkeypatch.setattr(secure_aggregation, "COMPATIBLE", secure_aggregation.COMPATIBLE | {"FailOn"})
    plain = build_federation(tmp_path, [FailOn("site1", 1)], rounds=3, run_name="plain")
    with pytest.warns(UserWarning, match="client 'site1' failed"):
        plain.run()
    secure = build_federation(
        tmp_path, [SecureAggregation(bits=BITS), FailOn("site1", 1)], rounds=3, run_name="secure", transport=transport
    )
    with pytest.warns(UserWarning, match=r"round 2's selected client\(s\) \['site1'\] did not answer: their masks"):
        summary = secure.run()
    assert summary["secure_aggregation"]["remasked_rounds"] == 1
    _float_states_close(secure.groups[0].state, plain.groups[0].state, atol=3 * 3 * 2.0 ** -(BITS + 1) + 1e-6)


def test_with_one_survivor_the_round_is_refused_and_its_sum_never_applied(tmp_path, monkeypatch):
    monkeypatch.setattr(secure_aggregation, "COMPATIBLE", secure_aggregation.COMPATIBLE | {"FailOn"})
    data = tiny_data(num_clients=2)
    fed = build_federation(tmp_path, [SecureAggregation(), FailOn("site1", 1)], rounds=2, data=data)
    before = {}
    save = fed.save_checkpoint

    def keep_round_1_state():
        before.update({k: v.clone() for k, v in fed.groups[0].state.items()})
        return save()

    fed.save_checkpoint = keep_round_1_state
    with pytest.warns(UserWarning, match="client 'site1' failed"):
        with pytest.raises(RuntimeError, match=r"only \['site0'\] did: a masked sum needs two clients"):
            fed.run()
    assert before
    for k, v in before.items():  # the round's sum was never applied
        assert torch.equal(fed.groups[0].state[k], v), k


def test_mask_corrections_make_the_survivors_masks_cancel_alone():
    values = {c: torch.randn(50, dtype=torch.float64) * 0.1 for c in IDS}
    private, public = _keys()
    uploads = {
        c: secagg.masked_upload(v, secagg.client_mask(c, private[c], public, 50, "run", 3, "global"), BITS, 4)
        for c, v in values.items()
    }
    survivors = ["a", "c", "d"]
    after = {c: public[c] for c in survivors}
    sessions = ("run", secagg.retry_session("run", ["b"]))
    fixes = [
        torch.from_numpy(
            secagg.mask_correction(c, private[c], public, after, 50, sessions, 3, "global").view(np.int64).copy()
        )
        for c in survivors
    ]
    total = secagg.unmasked_sum([*(uploads[c] for c in survivors), *fixes], BITS)
    assert torch.allclose(total, sum(values[c] for c in survivors), atol=3 * 2.0 ** -(BITS + 1), rtol=0)
    garbage = secagg.unmasked_sum([uploads[c] for c in survivors], BITS)  # without the corrections: no sum
    assert (garbage - sum(values[c] for c in survivors)).abs().max() > 1.0
    # a correction alone tells nothing about the update: it holds masks only
    assert abs(np.corrcoef(fixes[0].double().numpy(), values["a"].numpy())[0, 1]) < 0.5


def test_a_client_refuses_a_remask_that_could_expose_its_upload():
    from types import SimpleNamespace

    cb = SecureAggregation()
    private, public = _keys(["a", "b", "c"])
    hexed = {c: k.hex() for c, k in public.items()}
    ctx = SimpleNamespace(client_id="a", group="global", state={"private_key": private["a"].hex()})
    ctx.state["masked"] = [4, "global", ["a", "b", "c"]]
    ask = {"round": 4, "before": hexed, "after": {c: hexed[c] for c in "ab"}, "session": "s", "retry": "s|x",
           "size": 8}  # fmt: skip
    assert cb.answer_query(ctx, "remask", ask).dtype == torch.int64
    for bad, why in [
        ({"round": 3}, "it masked no upload of that round"),
        ({"before": {c: hexed[c] for c in "ab"}, "after": {"a": hexed["a"], "b": hexed["b"]}}, "peers it masked"),
        ({"after": {"a": hexed["a"]}}, "two or more of the old ones with it"),  # alone: its upload unmasked
        ({"after": {c: hexed[c] for c in "bc"}}, "two or more of the old ones with it"),
        ({"after": hexed}, "two or more of the old ones with it"),  # nobody dropped: nothing to correct
    ]:
        with pytest.raises(ValueError, match=f"client 'a' refuses to re-mask: .*{why}"):
            cb.answer_query(ctx, "remask", {**ask, **bad})


@pytest.mark.parametrize("transport", ["inprocess", "serialized"])
def test_resume_and_the_serialized_transport_give_the_uninterrupted_in_process_weights(tmp_path, transport):
    full = build_federation(tmp_path, [SecureAggregation()], rounds=3, keep_checkpoints=0, run_name="full")
    full.run()
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    resumed = build_federation(
        tmp_path,
        [SecureAggregation()],
        rounds=3,
        keep_checkpoints=0,
        run_name="resumed",
        transport=transport,
        resume=str(checkpoint_path(tmp_path / "resumed", 2)),
    )
    resumed.run()
    for key, value in full.groups[0].state.items():  # masks differ (fresh keys per run), the exact sums do not
        assert torch.equal(value, resumed.groups[0].state[key]), key
