"""``model.init_args.net``: any ``torch.nn.Module`` by class path (MONAI's or one's own), checked before training.

MONAI nets are kept tiny (a DenseNet with ``block_config=(1, 1)``, a UNet with channels (4, 8)); one DenseNet121 is
only constructed. The runs go through ``train.py``'s main for one round on 20 images per client.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import Tensor, nn

from callbacks import FedBN
from fl_lightning.cli import build_cli, main
from fl_lightning.clients import ClassificationClient, SegmentationClient
from fl_lightning.models.net_check import check_net_shapes
from fl_lightning.outputs.checkpoint import find_last_checkpoint
from fl_lightning.outputs.config_diff import diff_configs, load_saved_config
from tests.anchors.runs import describe

# torch's own normalisation classes, listed here rather than taken from callbacks.fedbn (an independent walk)
NORMS = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm,
)  # fmt: skip

TINY = [
    "--federation.rounds=1",
    "--trainer.logger=false",
    "--federation.progress=false",
    "--federation.plots=false",
    "--data.max_samples_per_client=20",
    "--data.image_size=16",
]

# Tiny MONAI nets for the digits (1 channel, 10 classes) and the digit segmentation (1 channel, 5 classes).
DENSENET = {
    "class_path": "monai.networks.nets.DenseNet",
    "init_args": {"spatial_dims": 2, "in_channels": 1, "out_channels": 10, "init_features": 4, "growth_rate": 4,
                  "block_config": [1, 1]},
}  # fmt: skip
UNET = {
    "class_path": "monai.networks.nets.UNet",
    "init_args": {"spatial_dims": 2, "in_channels": 1, "out_channels": 5, "channels": [4, 8], "strides": [2],
                  "norm": "batch"},
}  # fmt: skip
TASKS = {"classification": ("digits", DENSENET), "segmentation": ("digits_seg", UNET)}


class TinyNet(nn.Module):
    """A plain torch classifier given by class path (``tests.clients.test_class_path_nets.TinyNet``).

    Args:
        in_channels: Image channels.
        num_classes: Output logits.
        width: Channels of the convolution.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1)
        self.scale = nn.GroupNorm(2, width)  # a norm layer whose name does not say so
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits, shape (N, num_classes)."""
        return self.head(torch.relu(self.scale(self.conv(x))).mean((2, 3)))


class TwoOutputs(nn.Module):
    """A net returning (logits, features), as some deep-supervision nets do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyNet()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits and the input."""
        return self.net(x), x


def norm_module_keys(net: nn.Module, prefix: str = "") -> set[str]:
    """State keys of every normalisation module of ``net``, found by walking ``named_modules`` with isinstance."""
    keys = set()
    for name, sub in net.named_modules():
        if isinstance(sub, NORMS):
            keys.update(f"{prefix}{name}.{k}" for k in sub.state_dict())
    return keys


def overlay(tmp_path: Path, net: dict, name: str = "net.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"model": {"init_args": {"net": net}}}))
    return str(path)


def run_args(config: str, tmp_path: Path, net: dict, run_name: str = "r") -> list[str]:
    return ["--config", config, "--config", overlay(tmp_path, net), *TINY, f"--federation.output_dir={tmp_path}",
            f"--federation.run_name={run_name}"]  # fmt: skip


def monai_nets():
    return pytest.importorskip("monai.networks.nets", reason="MONAI nets need the `medical` extra")


# ---------------------------------------------------------------------------------------------- the shape check
def test_the_check_leaves_modes_buffers_and_random_streams_as_they_were():
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm2d(1)
            self.frozen = nn.BatchNorm2d(1).eval()  # a submodule the user keeps in eval mode
            self.head = nn.Linear(1, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.frozen(self.bn(x + torch.rand_like(x))).mean((2, 3)))

    net = Noisy()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    check_net_shapes(net, 1, (8, 8), (2, 3), "(N, 3) logits")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert net.training and net.bn.training and not net.frozen.training


def test_the_check_materialises_a_lazy_net():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.LazyBatchNorm2d(), nn.Flatten(), nn.LazyLinear(10))
    check_net_shapes(net, 1, (8, 8), (2, 10), "(N, 10) logits")
    assert net[3].weight.shape == (10, 4 * 6 * 6) and torch.equal(net[1].running_mean, torch.zeros(4))


@pytest.mark.parametrize(
    ("net", "expected", "needles"),
    [
        (TinyNet(1, 3), (2, 10), ["returns shape (2, 3)", "expected (2, 10)", "out_channels) to 10"]),
        (
            TinyNet(3, 10),
            (2, 10),
            ["does not take the data's images", "(2, 1, 8, 8)", "`conv` takes 3 input channels", "in_channels) to 1"],
        ),
        (nn.Conv2d(1, 5, 3, stride=2, padding=1), (2, 5, 8, 8), ["returns shape (2, 5, 4, 4)", "height and width"]),
        (TwoOutputs(), (2, 10), ["returns tuple, not a tensor"]),
    ],
    ids=["outputs", "in_channels", "spatial", "tuple"],
)
def test_a_net_of_the_wrong_shape_is_refused_naming_the_key_and_both_shapes(net, expected, needles):
    with pytest.raises(ValueError) as err:
        check_net_shapes(net, 1, (8, 8), expected, "what it means")
    message = str(err.value)
    assert message.startswith("model.init_args.net (") and "\n" not in message
    for needle in ["data.in_channels=1", "data.image_size=(8, 8)", *needles]:
        assert needle in message, (needle, message)


def test_without_net_the_builtin_network_is_unchanged():
    torch.manual_seed(0)
    client = ClassificationClient(arch="cnn", width=4, image_size=(8, 8))
    assert type(client.net).__name__ == "SmallCNN" and "net" not in client.hparams
    assert type(SegmentationClient(width=4, image_size=(8, 8)).net).__name__ == "UNet"


# ---------------------------------------------------------------------------------------------- norm layers
def test_fedbn_finds_the_norm_layers_of_monai_nets_by_type():
    nets = monai_nets()
    densenet121 = nets.DenseNet121(spatial_dims=2, in_channels=3, out_channels=2)  # constructed, never trained
    client = ClassificationClient(num_classes=2, in_channels=3, image_size=(32, 32), net=densenet121)
    expected = norm_module_keys(densenet121, "net.")
    assert {"net.features.norm0.running_mean", "net.features.denseblock1.denselayer1.layers.norm1.weight"} <= expected
    assert FedBN().private_keys(client) == expected
    for net, has_state in [
        (nets.UNet(2, 1, 5, channels=(4, 8), strides=(2,), norm="batch"), True),
        (nets.UNet(2, 1, 5, channels=(4, 8), strides=(2,)), False),  # MONAI's default: InstanceNorm, no state
        (nets.BasicUNet(2, 1, 5, features=(4, 4, 8, 8, 16, 4)), True),  # InstanceNorm with affine parameters
    ]:
        seg = SegmentationClient(num_classes=5, image_size=(32, 32), net=net)  # BasicUNet halves 4 times
        expected = norm_module_keys(net, "net.")
        assert FedBN().private_keys(seg) == expected and bool(expected) == has_state
        assert all(".adn.N." in k for k in expected)  # MONAI's own name for the norm of a conv block


# ---------------------------------------------------------------------------------------------- runs
@pytest.mark.parametrize("task", TASKS)
def test_a_monai_net_trains_with_fedbn_its_norm_layers_private(task, tmp_path):
    monai_nets()
    data, net = TASKS[task]
    summary = main(run_args(f"configs/fedbn_{data}.yaml", tmp_path, net))
    run = tmp_path / "r"
    assert summary["clients"] and (run / "summary.json").is_file()
    _, checkpoint = find_last_checkpoint(run)
    global_state = checkpoint["groups"][0]["state"]
    rebuilt = build_cli(["--config", str(run / "config.yaml"), "--trainer.logger=false"])
    expected = norm_module_keys(rebuilt.model.net, "net.")
    assert expected and all(".norm" in k or ".N." in k for k in expected)
    for cid, groups in checkpoint["runtime"]["private"].items():
        assert set(groups["global"]) == expected, cid  # exactly the norm modules' state, by type
    assert expected < set(global_state)
    # config.yaml holds the net by class path and re-parses to the same net (what a resume compares)
    saved = load_saved_config(run)
    assert saved["model"]["init_args"]["net"]["class_path"] == net["class_path"]
    assert saved["model"]["init_args"]["net"]["init_args"].items() >= net["init_args"].items()
    assert diff_configs(saved, rebuilt.config.clone().as_dict()).refused == {}
    assert type(rebuilt.model.net).__name__ == net["class_path"].rsplit(".", 1)[-1]
    shapes = {k: v.shape for k, v in rebuilt.model.state_dict().items() if k.startswith("net.")}
    assert shapes == {k: v.shape for k, v in global_state.items() if k.startswith("net.")}


@pytest.mark.parametrize("task", TASKS)
def test_a_monai_net_trains_with_harmofl(task, tmp_path):
    monai_nets()
    data, net = TASKS[task]
    summary = main(run_args(f"configs/harmofl_{data}.yaml", tmp_path, net))
    _, checkpoint = find_last_checkpoint(tmp_path / "r")
    state = checkpoint["groups"][0]["state"]
    assert bool(state["input_norm.frozen"]) and state["input_norm.amplitude"].shape[-2:] == (16, 16)
    assert any(k.startswith("net.") for k in state)  # the amplitude layer sits in front of the MONAI net
    rows = (tmp_path / "r" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + len(summary["clients"]) and "nan" not in rows[1]


def test_a_plain_torch_module_by_class_path_trains_alike_on_both_transports(tmp_path):
    """The serialized transport builds its client runtime from the same arguments: the same net, the same run."""
    net = {"class_path": "tests.clients.test_class_path_nets.TinyNet", "init_args": {"width": 4}}
    for transport in ("inprocess", "serialized"):
        main([*run_args("configs/fedbn_digits.yaml", tmp_path, net, transport), f"--federation.transport={transport}"])
    _, checkpoint = find_last_checkpoint(tmp_path / "inprocess")
    private = next(iter(checkpoint["runtime"]["private"].values()))["global"]
    assert set(private) == {"net.scale.weight", "net.scale.bias"}  # the GroupNorm, found by type
    assert describe(tmp_path / "serialized")["sha256"] == describe(tmp_path / "inprocess")["sha256"]


@pytest.mark.parametrize(
    ("config", "net", "needles"),
    [
        (
            "configs/fedbn_digits.yaml",
            {**DENSENET, "init_args": {**DENSENET["init_args"], "out_channels": 2}},
            [
                "ClassificationClient",
                "monai.networks.nets.densenet.DenseNet",
                "returns shape (2, 2)",
                "expected (2, 10)",
                "data.num_classes=10",
            ],
        ),
        (
            "configs/harmofl_digits_seg.yaml",
            {**UNET, "init_args": {**UNET["init_args"], "in_channels": 3}},
            [
                "SegmentationClient",
                "monai.networks.nets.unet.UNet",
                "does not take the data's images",
                "(2, 1, 16, 16)",
                "takes 3 input channels",
                "data.in_channels=1",
            ],
        ),
    ],
    ids=["outputs", "in_channels"],
)
def test_a_net_that_does_not_fit_the_data_is_refused_before_training(config, net, needles, tmp_path):
    monai_nets()
    out = tmp_path / "runs"
    with pytest.raises(ValueError) as err:
        main(run_args(config, tmp_path, net)[:-2] + [f"--federation.output_dir={out}"])
    message = str(err.value)
    assert message.startswith("invalid model (") and "model.init_args.net" in message and "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    assert not out.exists()  # nothing trained, nothing written
