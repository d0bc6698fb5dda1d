"""The survival client: FedAvg of a Cox model through train.py, the pooled C-index, the fit against lifelines."""

from __future__ import annotations

import math
import re
from typing import Any

import lightning as L
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from lifelines import CoxPHFitter
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from datamodules.survival_synthetic import SyntheticSurvivalFederated
from fl_lightning.cli import main
from fl_lightning.clients.survival import SurvivalClient
from fl_lightning.ops.survival import concordance_index, cox_partial_likelihood

CONFIG = "configs/cox_synthetic.yaml"
CPU = torch.device("cpu")


def _trainer(epochs: int) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip


def test_fedavg_cox_through_train_py_beats_a_constant_predictor(tmp_path):
    """The shipped config, through the real entry point: mean test C-index over the sites > 0.6 (a constant: 0.5)."""
    summary = main([
        "--config", CONFIG, "--trainer.logger=false", "--federation.progress=false",
        f"--federation.output_dir={tmp_path}", "--federation.run_name=cox",
    ])  # fmt: skip
    stats = summary["summary"]["global"]["c_index"]
    assert stats["mean"] > 0.6 and stats["worst"] > 0.55
    assert set(summary["clients"]) == {"site0", "site1", "site2", "site3"}
    assert 0.6 < summary["pooled"]["c_index"] <= 1.0

    # the same sites' test sets, scored by a constant risk (the linear model at zero weights)
    data_args = yaml.safe_load(open(CONFIG))["data"]["init_args"]
    data = SyntheticSurvivalFederated(**data_args)
    constant = SurvivalClient(num_features=data.num_features)
    nn.init.zeros_(constant.net.classifier.weight)
    for cid in data.client_ids:
        assert constant.evaluate(data.client_test_loader(cid), CPU)["c_index"] == 0.5


def _risk_parts(seed: int, sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in sizes:
        time = torch.randint(1, 8, (n,), generator=g).float()  # tied times
        event = (torch.rand(n, generator=g) < 0.6).float()
        risk = torch.randint(-2, 3, (n,), generator=g).float()  # tied risks
        parts.append({"risk": risk, "targets": torch.stack([time, event], 1)})
    return parts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pooled_metrics_from_merged_parts_are_those_of_the_concatenated_predictions(seed):
    client = SurvivalClient(num_features=3)
    parts = _risk_parts(seed, [7, 20, 13])
    pooled = client.metrics_from_parts(client.merge_parts(parts))
    risk = torch.cat([p["risk"] for p in parts])
    targets = torch.cat([p["targets"] for p in parts])
    assert pooled["c_index"] == concordance_index(risk, targets[:, 0], targets[:, 1])
    assert pooled["loss"] == pytest.approx(cox_partial_likelihood(risk, targets[:, 0], targets[:, 1]).item())
    # not a mean of the per-site values: pairs across sites count too
    per_site = [client.metrics_from_parts(p)["c_index"] for p in parts]
    assert pooled["c_index"] != pytest.approx(float(np.mean(per_site)))


def test_evaluate_is_exact_whatever_the_batches():
    torch.manual_seed(0)
    client = SurvivalClient(num_features=4, arch="mlp", width=8)
    x = torch.randn(50, 4)
    y = torch.stack([torch.rand(50), (torch.rand(50) < 0.7).float()], 1)
    whole = client.evaluate([(x, y)], CPU)
    split = client.evaluate([(x[:9], y[:9]), (x[9:30], y[9:30]), (x[30:], y[30:])], CPU)
    assert split == pytest.approx(whole)
    with torch.no_grad():
        risk = client(x)
    assert risk.shape == (50,)
    assert whole["c_index"] == concordance_index(risk, y[:, 0], y[:, 1])
    assert whole["loss"] == pytest.approx(cox_partial_likelihood(risk, y[:, 0], y[:, 1]).item())


def test_a_set_without_events_has_no_loss_and_no_cindex():
    client = SurvivalClient(num_features=2)
    y = torch.stack([torch.arange(5.0), torch.zeros(5)], 1)
    metrics = client.evaluate([(torch.randn(5, 2), y)], CPU)
    assert math.isnan(metrics["loss"]) and math.isnan(metrics["c_index"])


def test_a_batch_without_events_steps_nothing():
    torch.manual_seed(0)
    client = SurvivalClient(num_features=3, arch="mlp", width=4, optimizer="sgd", lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in client.state_dict().items()}
    x, y = torch.randn(8, 3), torch.stack([torch.rand(8), torch.zeros(8)], 1)
    optimizer = client.configure_optimizers()
    loss = client.training_loss((x, y))
    assert loss.item() == 0.0
    loss.backward()
    optimizer.step()
    assert all(torch.equal(before[k], v) for k, v in client.state_dict().items())


def test_linear_cox_client_fitted_by_the_trainer_reaches_lifelines_coefficients():
    """One site's training rows, full-batch SGD: the maximum partial likelihood estimate is lifelines' (no ties)."""
    data = SyntheticSurvivalFederated(num_clients=1, samples_per_client=150, num_features=4, seed=3)
    split = data.client_data("site0")
    x, y = split.train_x, split.train_y
    assert len(torch.unique(y[:, 0])) == len(y)  # no tied times: Efron (lifelines) is Breslow
    frame = pd.DataFrame(x.double().numpy(), columns=list("abcd"))
    frame = frame.assign(T=y[:, 0].double().numpy(), E=y[:, 1].double().numpy())
    reference = torch.from_numpy(CoxPHFitter().fit(frame, "T", "E").params_.to_numpy())

    torch.manual_seed(0)
    client = SurvivalClient(num_features=4, optimizer="sgd", lr=1.0, momentum=0.5)
    at_init = client.evaluate([(x, y)], CPU)["loss"]
    _trainer(100).fit(client, DataLoader(TensorDataset(x, y), batch_size=len(x)))
    weights = client.net.classifier.weight.detach().double().ravel()

    torch.testing.assert_close(weights, reference, atol=1e-3, rtol=0)
    assert client.evaluate([(x, y)], CPU)["loss"] < at_init


def test_the_network_sees_the_input_norm_and_has_no_bias():
    client = SurvivalClient(num_features=3, arch="mlp", width=5)
    assert client.net.classifier.bias is None
    x = torch.randn(6, 3)
    with torch.no_grad():
        plain = client(x)
        client.input_norm = _Scale(0.5)  # installed as a method would (HarmoFL's prepare_module)
        assert torch.allclose(client(x), client.net(0.5 * x)) and not torch.allclose(client(x), plain)
    linear = SurvivalClient(num_features=3)
    assert [p.shape for p in linear.parameters()] == [torch.Size([1, 3])]


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.factor * x


def test_loss_terms_get_the_forward_pass_representation():
    torch.manual_seed(0)
    client = SurvivalClient(num_features=3, arch="mlp", width=4)
    seen: dict[str, Any] = {}

    def term(**kwargs: Any) -> torch.Tensor:
        seen.update(kwargs)
        return kwargs["features"].sum() * 0 + 1.0

    x, y = torch.randn(8, 3), torch.stack([torch.rand(8), torch.ones(8)], 1)
    plain = client.training_loss((x, y))
    client.loss_terms["t"] = term
    assert client.training_loss((x, y)).item() == pytest.approx(plain.item() + 1.0)
    assert torch.equal(seen["features"], client.net.features(x)) and seen["logits"].shape == (8,)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"num_features": 0}, "model.init_args.num_features"),
        ({"arch": "cnn"}, "model.init_args.arch"),
        ({"arch": "mlp", "width": 0}, "model.init_args.width"),
        ({"lr": 0.0}, "model.init_args.lr"),
    ],
)
def test_bad_arguments_name_the_key(kwargs: dict[str, Any], key: str):
    value = list(kwargs.values())[-1]
    with pytest.raises(ValueError, match=f"{re.escape(key)}.*got {re.escape(repr(value))}"):
        SurvivalClient(**kwargs)
