"""LocalFineTuning (FedAvg+): k = 0 is FedAvg, k epochs match a plain PyTorch loop, the federated run is untouched."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import FedBN, FederatedCallback, FedProx, LocalFineTuning, LRSchedule
from datamodules.sampler import SeededEpochSampler, stable_seed
from fl_lightning.errors import PreconditionError
from tests.conftest import build_federation, reference_sgd, tiny_data, tiny_model

CPU = torch.device("cpu")


class FitRecorder(L.Callback):
    """A plain Lightning callback (stays attached while fine-tuning): the module's weights after every fit."""

    def __init__(self):
        self.states = []

    def on_train_end(self, trainer, pl_module):
        self.states.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


class TrainStartCounter(FederatedCallback):
    """A federated callback with a Lightning hook: counts the fits it takes part in."""

    def __init__(self):
        self.fits = 0

    def on_train_start(self, trainer, pl_module):
        self.fits += 1


def net_part(state):
    return {k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")}


def finetune_batches(data, client_id, epochs):
    """The batches of the fine-tuning: a fresh sampler seeded from (data seed, client, "finetune")."""
    split = data.client_data(client_id)
    sampler = SeededEpochSampler(len(split.train_y), stable_seed(data.seed, client_id, "finetune"))
    loader = DataLoader(TensorDataset(split.train_x, split.train_y), batch_size=data.batch_size, sampler=sampler)
    return [list(loader) for _ in range(epochs)]


def check_against_reference(fed, recorder, epochs, lr, momentum):
    """Each client's fine-tuned weights and metrics equal a plain SGD loop from the final global weights."""
    data, ids = fed.data, list(fed.data.client_ids)
    final = fed.groups[0].state
    finetuned = fed.last_evaluation["clients"]["finetuned"]
    assert set(finetuned) == set(ids)
    assert len(recorder.states) == fed.config.rounds * len(ids) + len(ids)  # the last fits are the fine-tunings
    start = tiny_model(data, momentum=momentum)
    for cid, got in zip(ids, recorder.states[-len(ids) :]):
        start.load_state_dict(final)
        # one optimiser over the k epochs, as one Lightning fit of k epochs has
        batches = finetune_batches(data, cid, epochs)
        expected = reference_sgd(start.net, batches, lr=lr, momentum=momentum, fresh_optimizer_each_round=False)
        for k, v in expected.items():
            torch.testing.assert_close(net_part(got)[k], v, rtol=0, atol=1e-6, msg=k)
        start.load_state_dict({**final, **{f"net.{k}": v for k, v in expected.items()}})
        reference_metrics = start.evaluate(data.client_test_loader(cid), CPU)
        assert finetuned[cid] == pytest.approx(reference_metrics, abs=1e-5)
        assert finetuned[cid]["loss"] != fed.last_evaluation["clients"]["global"][cid]["loss"]  # it trained


def test_zero_epochs_is_fedavg(tmp_path):
    fed = build_federation(tmp_path, [LocalFineTuning(epochs=0)], rounds=2)
    fed.run()
    clients = fed.last_evaluation["clients"]
    assert set(clients["finetuned"]) == set(fed.data.client_ids)
    assert clients["finetuned"] == clients["global"]  # exactly
    assert fed.last_evaluation["summary"]["finetuned"] == fed.last_evaluation["summary"]["global"]


def test_zero_epochs_starts_from_the_personalised_model(tmp_path):
    fed = build_federation(tmp_path, [FedBN(), LocalFineTuning(epochs=0)], rounds=1)
    fed.run()
    clients = fed.last_evaluation["clients"]
    assert clients["finetuned"] == clients["personal"]
    assert clients["personal"] != clients["global"]  # the private norm layers matter here


@pytest.mark.parametrize("epochs", [1, 2])
def test_fine_tuning_equals_a_plain_pytorch_loop(tmp_path, epochs):
    recorder = FitRecorder()
    fed = build_federation(
        tmp_path, [LocalFineTuning(epochs=epochs), recorder], rounds=1, model_kwargs={"momentum": 0.9}
    )
    summary = fed.run()
    check_against_reference(fed, recorder, epochs, lr=0.1, momentum=0.9)
    assert "finetuned" in summary["summary"] and "finetuned" in summary["clients"]["site0"]


def test_other_federated_callbacks_are_detached_while_fine_tuning(tmp_path):
    # A large proximal term would keep the fine-tuned weights at the start; detached, it must not act at all.
    recorder, counter = FitRecorder(), TrainStartCounter()
    fed = build_federation(tmp_path, [FedProx(mu=10.0), counter, LocalFineTuning(epochs=1), recorder], rounds=1)
    callbacks = list(fed.trainer.callbacks)
    fed.run()
    check_against_reference(fed, recorder, 1, lr=0.1, momentum=0.0)
    assert counter.fits == len(fed.data.client_ids)  # the federated fits only, none of the fine-tunings
    assert fed.trainer.callbacks == callbacks


def test_fine_tuning_continues_at_the_last_rounds_learning_rate(tmp_path):
    # LRSchedule is detached, but the factor it set for the last round (0.5^1) stays on the module.
    recorder = FitRecorder()
    schedule = LRSchedule(kind="exponential", gamma=0.5)
    fed = build_federation(tmp_path, [schedule, LocalFineTuning(epochs=1), recorder], rounds=2)
    fed.run()
    check_against_reference(fed, recorder, 1, lr=0.05, momentum=0.0)
    assert fed.module.lr_factor == 0.5


def test_the_federated_run_is_unchanged(tmp_path):
    plain = build_federation(tmp_path / "a", rounds=3)
    tuned = build_federation(tmp_path / "b", [LocalFineTuning(epochs=1, every_eval=True)], rounds=3)
    plain.run(), tuned.run()
    for k, v in plain.groups[0].state.items():
        assert torch.equal(tuned.groups[0].state[k], v), k
    assert tuned.data.sampler_state() == plain.data.sampler_state()  # the persistent samplers did not advance
    for a, b in zip(plain.run_dir.round_rows, tuned.run_dir.round_rows):
        assert {k: v for k, v in a.items() if k.startswith("eval/global/")} == {
            k: v for k, v in b.items() if k.startswith("eval/global/")
        }
        assert "eval/finetuned/acc" in b  # every_eval: fine-tuned at every evaluation
    assert tuned.last_evaluation["clients"]["global"] == plain.last_evaluation["clients"]["global"]


def test_only_the_final_evaluation_fine_tunes_by_default(tmp_path):
    fed = build_federation(tmp_path, [LocalFineTuning(epochs=1)], rounds=2)
    fed.run()
    rows = fed.run_dir.round_rows
    assert "eval/finetuned/acc" not in rows[0] and "eval/finetuned/acc" in rows[1]


def test_module_rng_and_callbacks_are_restored(tmp_path):
    cb = LocalFineTuning(epochs=1)
    fed = build_federation(tmp_path, [cb], rounds=1)
    fed.run()
    callbacks = fed.trainer.callbacks
    before = {k: v.clone() for k, v in fed.module.state_dict().items()}
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    out = cb.extra_evaluation(fed)  # after the run (round == rounds) it fine-tunes the final model
    assert set(out["finetuned"]) == set(fed.data.client_ids)
    assert torch.equal(torch.rand(3), expected_draw)
    assert fed.trainer.callbacks is callbacks
    for k, v in fed.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_callbacks_are_restored_when_fine_tuning_fails(tmp_path, monkeypatch):
    cb = LocalFineTuning(epochs=1)
    fed = build_federation(tmp_path, [cb], rounds=1)
    fed.run()
    callbacks = fed.trainer.callbacks

    def broken_fit(*args, **kwargs):
        assert cb not in fed.trainer.callbacks and fed.transport.runtime.fitter.probe in fed.trainer.callbacks
        raise PreconditionError("no")

    monkeypatch.setattr(fed.transport.runtime.fitter, "fit", broken_fit)
    with pytest.raises(PreconditionError):
        cb.extra_evaluation(fed)
    assert fed.trainer.callbacks is callbacks and cb in callbacks


def test_a_client_in_several_sample_groups_fine_tunes_its_first_group_model(tmp_path):
    cb = LocalFineTuning(epochs=0)
    fed = build_federation(tmp_path, [cb], rounds=1)
    fed.run()
    group = fed.groups[0]
    assignments = {c: torch.arange(fed.num_samples(c)) % 2 for c in group.members}
    fed.split_samples(group, assignments, 2)
    fed.groups[1].state = {k: v + 1 if v.is_floating_point() else v for k, v in fed.groups[1].state.items()}
    with pytest.warns(UserWarning, match="several sample-level groups"):
        evaluation = fed.evaluate()
    assert evaluation["clients"]["finetuned"] == evaluation["clients"]["global"]


def test_bad_arguments_and_modes_fail_clearly(tmp_path):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="epochs"):
            LocalFineTuning(epochs=bad)
    for mode in ("local", "centralized"):
        with pytest.raises(ValueError, match=f"federation.mode={mode}"):
            build_federation(tmp_path, [LocalFineTuning()], mode=mode)
        config = SimpleNamespace(mode=mode, topology="star")
        with pytest.raises(ValueError, match=f"LocalFineTuning needs federation.mode=federated.*mode={mode}"):
            LocalFineTuning().on_federation_start(SimpleNamespace(config=config))
    fed = build_federation(tmp_path, [LocalFineTuning()], data=tiny_data(num_clients=2), topology="peer_to_peer")
    with pytest.raises(ValueError, match="federation.topology=star"):
        fed.run()
