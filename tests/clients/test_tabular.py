"""Tabular clients: FLamby's logistic regression (loss, gradient, initialisation, accuracy), other nets, arguments."""

from __future__ import annotations

import re
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fl_lightning.clients import TabularClient
from fl_lightning.models.tabular import BinaryLogit


class FlambyBaseline(nn.Module):
    """FLamby's Fed-Heart-Disease model (flamby/datasets/fed_heart_disease/model.py), copied: sigmoid of a linear."""

    def __init__(self, input_dim: int = 13, output_dim: int = 1) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(input_dim, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(x))


def _binary_logit(client: TabularClient) -> BinaryLogit:
    layer = client.net.classifier
    assert isinstance(layer, BinaryLogit)
    return layer


def _baseline_like(client: TabularClient) -> FlambyBaseline:
    """FLamby's model with the client's weights."""
    ref = FlambyBaseline(client.hparams.num_features)
    ref.linear.load_state_dict(_binary_logit(client).linear.state_dict())
    return ref


@pytest.mark.parametrize("seed", [0, 3])
def test_binary_cross_entropy_and_its_gradient_are_flambys(seed: int) -> None:
    """The client's loss on ``[0, z]`` logits equals BCEWithLogitsLoss(z) and BCELoss(sigmoid(z)), gradients too.

    ``softmax([0, z])[1]`` is FLamby's output ``sigmoid(z)``.
    """
    torch.manual_seed(seed)
    client = TabularClient(num_features=6)
    x, y = torch.randn(16, 6), torch.randint(0, 2, (16,))
    ref, ref_sigmoid = _baseline_like(client), _baseline_like(client)

    loss = client.training_loss((x, y))
    loss.backward()
    with_logits = nn.BCEWithLogitsLoss()(ref.linear(x).squeeze(1), y.float())
    with_logits.backward()
    on_sigmoid = nn.BCELoss()(ref_sigmoid(x).squeeze(1), y.float())
    on_sigmoid.backward()

    torch.testing.assert_close(loss, with_logits)
    torch.testing.assert_close(loss, on_sigmoid)
    torch.testing.assert_close(client(x).softmax(1)[:, 1], ref(x).squeeze(1))
    mine = _binary_logit(client).linear
    for other in (ref.linear, ref_sigmoid.linear):
        torch.testing.assert_close(mine.weight.grad, other.weight.grad)
        torch.testing.assert_close(mine.bias.grad, other.bias.grad)


@pytest.mark.parametrize("seed", [0, 42, 46])
def test_initial_weights_are_flambys_baseline_after_the_same_seed(seed: int) -> None:
    """``TabularClient(num_features=13)`` after ``manual_seed(s)`` starts from FLamby's ``Baseline()`` after it.

    Its only parameters are that linear layer's 13 + 1 (nothing else is trained or averaged).
    """
    torch.manual_seed(seed)
    client = TabularClient(num_features=13)
    torch.manual_seed(seed)
    flamby = FlambyBaseline()

    layer = _binary_logit(client).linear
    assert torch.equal(layer.weight, flamby.linear.weight) and torch.equal(layer.bias, flamby.linear.bias)
    assert sum(p.numel() for p in client.parameters()) == 14


def _blobs(num_classes: int, n_per_class: int, num_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Separable Gaussian blobs: class k centred at 3·e_k (shifted and scaled, so BatchNorm has work to do)."""
    g = torch.Generator().manual_seed(1)
    y = torch.arange(num_classes).repeat_interleave(n_per_class)
    centres = 3.0 * torch.eye(num_classes, num_features)
    x = centres[y] + 0.5 * torch.randn(len(y), num_features, generator=g)
    return 10.0 + 4.0 * x, y


@pytest.mark.parametrize(
    ("kwargs", "layer"),
    [
        ({"arch": "logistic"}, nn.Linear),
        ({"arch": "mlp", "norm": "batch", "width": 8}, nn.BatchNorm1d),
    ],
    ids=["multiclass_logistic", "mlp_batchnorm"],
)
def test_multiclass_logistic_and_batchnorm_mlp_train_on_a_table(kwargs: dict[str, Any], layer: type) -> None:
    """Three classes: one Lightning fit brings the training loss under half its start and the accuracy over 0.9.

    The logistic model has one linear output per class (not the binary score); the MLP's BatchNorm1d learns the
    table's statistics (its running mean moves from 0 towards the features' mean).
    """
    x, y = _blobs(3, 30, 5)
    torch.manual_seed(0)
    client = TabularClient(num_classes=3, num_features=5, optimizer="adam", lr=0.05, **kwargs)
    modules = [m for m in client.net.modules() if type(m) is layer]
    assert modules and not any(isinstance(m, BinaryLogit) for m in client.net.modules())
    if layer is nn.Linear:
        assert client.net.classifier.out_features == 3
    batches = [(x, y)]
    before = client.evaluate(batches, torch.device("cpu"))

    trainer = L.Trainer(
        max_epochs=25, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer.fit(client, loader)
    after = client.evaluate(batches, torch.device("cpu"))

    assert after["loss"] < 0.5 * before["loss"] and after["acc"] > 0.9
    if layer is nn.BatchNorm1d:
        assert float(modules[0].running_mean.abs().mean()) > 0.1


def test_accuracy_is_sigmoid_above_one_half() -> None:
    """The evaluated accuracy of a binary model is ``((sigmoid(z) > 0.5) == y).mean()`` over all batches.

    Rows with z exactly 0 (sigmoid 0.5) are predicted healthy (0): they are labelled 1 here, so counting them as
    class 1 would show.
    """
    torch.manual_seed(5)
    client = TabularClient(num_features=4)
    with torch.no_grad():
        _binary_logit(client).linear.bias.zero_()
    x, y = torch.randn(30, 4), torch.randint(0, 2, (30,))
    x[:6], y[:6] = 0.0, 1  # z = 0: on the threshold
    z = _baseline_like(client).linear(x).squeeze(1)
    expected = ((torch.sigmoid(z) > 0.5).long() == y).double().mean().item()
    assert 0.2 < expected < 0.8  # neither all right nor all wrong

    metrics = client.evaluate([(x[:11], y[:11]), (x[11:], y[11:])], torch.device("cpu"))

    assert metrics["acc"] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"num_features": 0}, "model.init_args.num_features"),
        ({"num_classes": 1}, "model.init_args.num_classes"),
        ({"arch": "cnn"}, "model.init_args.arch"),
        ({"arch": "mlp", "norm": "group"}, "model.init_args.norm"),
        ({"arch": "mlp", "depth": 0}, "model.init_args.depth"),
        ({"arch": "mlp", "width": 0}, "model.init_args.width"),
        ({"arch": "mlp", "dropout": 1.0}, "model.init_args.dropout"),
        ({"lr": 0.0}, "model.lr"),
    ],
)
def test_bad_arguments_name_the_key(kwargs: dict[str, Any], key: str) -> None:
    """Each bad argument is refused when the client is built, the message naming its key and the value given."""
    value = list(kwargs.values())[-1]
    with pytest.raises(ValueError, match=f"{re.escape(key)}.*got {re.escape(repr(value))}"):
        TabularClient(**kwargs)


def test_unknown_optimiser_names_the_key() -> None:
    """An unknown optimiser is refused when the fit builds it, naming ``model.optimizer``."""
    client = TabularClient(optimizer="rmsprop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("model.optimizer must be sgd, adam or adamw, got 'rmsprop'")):
        client.configure_optimizers()
