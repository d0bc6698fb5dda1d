"""A rank's GPU comes from the parsed config: ``federation.workers_per_device`` from YAML, ``--key value`` or ``=``."""

from __future__ import annotations

import pytest

from fl_lightning import cli
from fl_lightning.cli import FederatedCLI, rank_devices


class Parsed(Exception):
    """Stops the CLI right after parsing, carrying the parsed config."""


class ParseOnly(FederatedCLI):
    def before_instantiate_classes(self) -> None:
        raise Parsed(self.config)


def start(cli_class: type[FederatedCLI], argv: list[str]):
    """``cli_class`` on ``argv`` with build_cli's settings (its subclass stops it with :class:`Parsed`)."""
    with pytest.raises(Parsed) as caught:
        cli_class(
            model_class=cli.ClientModule, datamodule_class=cli.FederatedDataModule, subclass_mode_model=True,
            subclass_mode_data=True, run=False, args=argv, trainer_defaults=cli.TRAINER_DEFAULTS,
            save_config_callback=None, auto_configure_optimizers=False,
        )  # fmt: skip
    return caught.value.args[0]


def parsed(argv: list[str]):
    return start(ParseOnly, argv)


@pytest.mark.parametrize("form", ["yaml", "space", "equals"])
def test_workers_per_device_is_read_from_the_parsed_config_in_every_form(tmp_path, form):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("federation:\n  workers_per_device: 2\n")
    argv = {
        "yaml": ["--config", str(yaml_file)],
        "space": ["--federation.workers_per_device", "2"],
        "equals": ["--federation.workers_per_device=2"],
    }[form]
    config = parsed(argv)
    assert config.federation.workers_per_device == 2
    # local ranks 0 and 1 share GPU 0, ranks 2 and 3 GPU 1
    assert [rank_devices(config, r, cuda=True) for r in range(4)] == [[0], [0], [1], [1]]


def test_a_cpu_run_or_a_machine_without_cuda_keeps_its_devices():
    assert rank_devices(parsed(["--trainer.accelerator", "cpu"]), 3, cuda=True) is None
    assert rank_devices(parsed([]), 3, cuda=False) is None
    assert rank_devices(parsed([]), 3, cuda=True) == [3]  # one rank per GPU by default


def test_the_cli_gives_a_cuda_rank_its_gpu_before_the_trainer_is_built(monkeypatch):
    seen = {}

    class Capture(FederatedCLI):
        def instantiate_classes(self) -> None:
            seen["devices"] = self.config.trainer.devices
            raise Parsed(None)

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)  # no GPU here: the test stands in for one
    start(Capture, ["--federation.workers_per_device", "2"])
    assert seen["devices"] == [1]
