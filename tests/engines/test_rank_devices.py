"""Ranks come from the parsed config: ``federation.workers`` and ``workers_per_device`` from YAML, ``--key value``
or ``--key=value``."""

from __future__ import annotations

import pytest

from fl_lightning import cli
from fl_lightning.cli import FederatedCLI, rank_devices


class Parsed(Exception):
    """Stops the CLI right after parsing, carrying the parsed config."""


class ParseOnly(FederatedCLI):
    def before_instantiate_classes(self) -> None:
        raise Parsed(self.config)


def start(cli_class: type[FederatedCLI], argv: list[str], launch_argv: list[str] | None = None):
    """``cli_class`` on ``argv`` with build_cli's settings (its subclass stops it with :class:`Parsed`)."""
    with pytest.raises(Parsed) as caught:
        cli_class(
            launch_argv=launch_argv,
            model_class=cli.ClientModule, datamodule_class=cli.FederatedDataModule, subclass_mode_model=True,
            subclass_mode_data=True, run=False, args=argv, trainer_defaults=cli.TRAINER_DEFAULTS,
            save_config_callback=None, auto_configure_optimizers=False,
        )  # fmt: skip
    return caught.value.args[0]


def setting_in(form: str, key: str, tmp_path) -> list[str]:
    """The arguments that set ``federation.<key>`` to 2 in one form: a YAML file, ``--key value`` or ``--key=value``."""
    if form == "yaml":
        yaml_file = tmp_path / "c.yaml"
        yaml_file.write_text(f"federation:\n  {key}: 2\n")
        return ["--config", str(yaml_file)]
    return [f"--federation.{key}", "2"] if form == "space" else [f"--federation.{key}=2"]


def parsed(argv: list[str]):
    return start(ParseOnly, argv)


@pytest.mark.parametrize("form", ["yaml", "space", "equals"])
def test_workers_per_device_is_read_from_the_parsed_config_in_every_form(tmp_path, form):
    argv = setting_in(form, "workers_per_device", tmp_path)
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


class Built(FederatedCLI):
    """Stops right before instantiating, after before_instantiate_classes ran."""

    def instantiate_classes(self) -> None:
        raise Parsed(self)


@pytest.fixture
def launches(monkeypatch):
    """The calls of the launcher (none started), outside any rank."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    calls = []
    monkeypatch.setattr(cli.local_ranks, "start", lambda argv, workers: calls.append((argv, workers)))
    return calls


@pytest.mark.parametrize("form", ["yaml", "space", "equals"])
def test_workers_start_the_local_ranks_from_the_parsed_config_in_every_form(tmp_path, form, launches):
    argv = setting_in(form, "workers", tmp_path)
    start(Built, argv, launch_argv=argv)
    assert launches == [(argv, 2)]


def test_no_ranks_start_for_one_worker_without_a_launch_or_on_a_rank(launches, monkeypatch):
    start(Built, ["--federation.workers=1"], launch_argv=["--federation.workers=1"])
    start(Built, ["--federation.workers=2"])  # a build that is not the run's own (the serialized runtime's)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    built = start(Built, ["--federation.workers=2"], launch_argv=["--federation.workers=2"])  # under torchrun
    assert launches == []
    assert built.rank == (1, 2, 0) and "RANK" not in cli.os.environ  # hidden from the Trainer about to be built


def test_a_failed_instantiation_after_the_ranks_started_stops_them(monkeypatch):
    closed = []

    class Group:
        def close(self, ok):
            closed.append(ok)

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(cli.local_ranks, "start", lambda argv, workers: Group())
    monkeypatch.setattr(cli.distributed, "environment_rank", lambda: None)  # the started ranks' variables: not set
    argv = ["--federation.workers=2", "--data.alpha=-1"]  # the datamodule refuses alpha < 0 when instantiated
    with pytest.raises(ValueError, match="alpha"):
        cli.build_cli(argv, launch=True)
    assert closed == [False]
