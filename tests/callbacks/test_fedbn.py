"""FedBN's private keys: every normalisation layer by type, whatever its name, and nothing else."""

import pytest
import torch
from torch import nn

from callbacks import FedBN
from callbacks.fedbn import NORM_TYPES, norm_state_keys

BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.inorm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.plain_inorm = nn.InstanceNorm2d(4)  # no affine parameters, no running stats: no state at all
        self.gn = nn.GroupNorm(2, 4)


class Zoo(nn.Module):
    """Every kind of normalisation layer, nested, under names that do and do not say so."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU())
        self.block = Block()
        self.head = nn.ModuleDict({"norm1d": nn.BatchNorm1d(8), "fc": nn.Linear(8, 8)})
        self.ln = nn.LayerNorm(8)
        self.ln_plain = nn.LayerNorm(8, elementwise_affine=False)  # no state
        self.bn = nn.Linear(8, 2)  # called "bn", but a linear layer
        self.no_stats = nn.BatchNorm1d(8, affine=False, track_running_stats=False)  # no state
        self.register_buffer("bn_scale", torch.ones(1))  # a buffer named like a norm, on the root


EXPECTED_NORM = (
    {f"stem.1.{k}" for k in BN_KEYS}
    | {f"block.inorm.{k}" for k in BN_KEYS}
    | {"block.gn.weight", "block.gn.bias"}
    | {f"head.norm1d.{k}" for k in BN_KEYS}
)
EXPECTED_LN = {"ln.weight", "ln.bias"}


def _keys_under(model, module_names):
    """The model's own state-dict keys that belong to the named submodules."""
    return {k for k in model.state_dict() if any(k.startswith(f"{name}.") for name in module_names)}


def test_norm_state_keys_finds_every_norm_layer_by_type():
    model = Zoo()
    keys = norm_state_keys(model)
    assert keys == EXPECTED_NORM
    assert keys <= set(model.state_dict())  # exactly the keys the Federation's state dicts carry
    assert keys == _keys_under(model, ["stem.1", "block.inorm", "block.gn", "head.norm1d", "no_stats"])
    assert not {"bn.weight", "bn.bias", "bn_scale", "head.fc.weight", "block.conv.weight"} & keys
    assert not any(k.startswith("ln") for k in keys)  # LayerNorm is not a FedBN layer by default


def test_fedbn_private_keys_and_layer_norm_option():
    model = Zoo()
    assert FedBN().private_keys(model) == EXPECTED_NORM
    assert FedBN(include_layer_norm=True).private_keys(model) == EXPECTED_NORM | EXPECTED_LN
    assert norm_state_keys(model, NORM_TYPES + (nn.LayerNorm,)) == _keys_under(
        model, ["stem.1", "block.inorm", "block.gn", "head.norm1d", "ln", "ln_plain"]
    )
    assert "bn.weight" not in FedBN(include_layer_norm=True).private_keys(model)


@pytest.mark.parametrize(
    ("layer", "expected"),
    [
        (nn.BatchNorm2d(3), set(BN_KEYS)),
        (nn.InstanceNorm2d(3, affine=True, track_running_stats=True), set(BN_KEYS)),
        (nn.InstanceNorm1d(3, affine=True), {"weight", "bias"}),
        (nn.GroupNorm(1, 3), {"weight", "bias"}),
        (nn.SyncBatchNorm(3), set(BN_KEYS)),
        (nn.Linear(3, 3), set()),
        (nn.LayerNorm(3), set()),
    ],
    ids=["bn2d", "instance_tracked", "instance_affine", "group", "syncbn", "linear", "layernorm"],
)
def test_a_norm_layer_at_the_root_has_unprefixed_keys(layer, expected):
    assert norm_state_keys(layer) == expected
    assert expected <= set(layer.state_dict())
