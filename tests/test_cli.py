"""LightningCLI conventions: composition, overrides, --print_config, --help, and errors that name the key."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from callbacks import FedProx
from fl_lightning import cli
from fl_lightning.cli import build_cli, main

BASE = "configs/fedavg_digits.yaml"


def test_overlay_composes_with_its_base_and_overrides_win():
    cli = build_cli(
        [
            "--config",
            BASE,
            "--config",
            "configs/fedprox_digits.yaml",
            "--federation.rounds=3",
            "--model.lr=0.01",
            "--data.alpha=0.1",
            "--data.partition=dirichlet",
        ]
    )
    assert cli.config.federation.rounds == 3
    assert cli.config.model.init_args.lr == 0.01 and cli.model.hparams.lr == 0.01
    assert cli.config.data.init_args.alpha == 0.1 and cli.datamodule.alpha == 0.1
    assert cli.config.data.init_args.num_clients == 5  # from the base file
    assert [type(cb) for cb in cli.trainer.callbacks if isinstance(cb, FedProx)] == [FedProx]
    # the data's shape is linked into the model
    assert cli.model.hparams.num_classes == 10 and cli.model.hparams.in_channels == 1


def test_an_overlay_alone_pulls_in_its_base():
    cli = build_cli(["--config", "configs/fedbn_digits.yaml"])
    assert cli.config.federation.rounds == 15 and type(cli.trainer.callbacks[0]).__name__ == "FedBN"


def test_print_config_is_complete(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/fedprox_digits.yaml", "--federation.rounds=4", "--print_config"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for needle in (
        "federation:",
        "rounds: 4",
        "client_fraction:",
        "class_path: callbacks.FedProx",
        "mu: 0.01",
        "class_path: datamodules.DigitsFederated",
        "max_epochs:",
        "seed_everything: 0",
    ):
        assert needle in out, needle


def test_help_shows_argument_docstrings(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Local epochs per selected client per round" in out
    assert "Fraction of clients sampled each round" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--federation.roundz=3"], "roundz"),
        (["--federation.rounds=three"], "federation.rounds"),
        (["--federation.aggregation=median"], "federation.aggregation"),
        (["--model.lrr=0.1"], "lrr"),
        (["--data.alphaa=0.1"], "alphaa"),
    ],
)
def test_bad_keys_and_types_fail_before_training_naming_the_key(args, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["--config", BASE, f"--federation.output_dir={tmp_path}", *args])
    assert exc.value.code != 0
    assert needle in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was trained or written


def test_unknown_key_in_a_config_file_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("federation:\n  rounds: 2\n  locl_epochs: 3\n")
    with pytest.raises(SystemExit):
        main(["--config", BASE, "--config", str(bad)])
    assert "locl_epochs" in capsys.readouterr().err


def test_invalid_value_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="federation.client_fraction=1.5"):
        main(["--config", BASE, "--federation.client_fraction=1.5", f"--federation.output_dir={tmp_path}"])


def test_missing_data_path_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "pathmnist.npz"
    with pytest.raises(FileNotFoundError, match="nowhere/pathmnist.npz"):
        main(["--config", BASE, "--data=datamodules.MedMNISTFederated", f"--data.path={missing}"])


def test_label_out_of_range_is_named(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 40), ("val", 10), ("test", 10)):
        arrays[f"{split}_images"] = rng.integers(0, 255, (n, 28, 28), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 3, (n, 1))
    arrays["test_labels"][4] = 7
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=r"bad\.npz") as exc:
        main(
            [
                "--config",
                BASE,
                "--data=datamodules.MedMNISTFederated",
                f"--data.path={path}",
                "--data.num_classes=3",
                "--data.num_clients=2",
            ]
        )
    assert "7" in str(exc.value)


def test_train_py_freezes_what_it_imported_and_leaves_the_collector_on():
    """train.py imports with the cyclic collector off, then freezes those objects; the run collects as usual."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    probe = "import gc, train; print(gc.isenabled(), gc.get_freeze_count())"
    out = subprocess.run([sys.executable, "-c", probe], cwd=repo, capture_output=True, text=True, check=True)
    enabled, frozen = out.stdout.split()
    assert enabled == "True" and int(frozen) > 100_000  # Lightning and torch alone are several 100,000 objects


def run_train_py(*args: str, **env: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "train.py", "--config", BASE, *args], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})  # fmt: skip


def test_a_user_error_before_training_is_one_line_with_exit_status_2(tmp_path):
    """Failed before: a ~45-line traceback from the CLI's instantiation ended with the message, exit status 1."""
    proc = run_train_py("--data.alpha=-1", f"--federation.output_dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "invalid data (datamodules.DigitsFederated): alpha must be > 0, got -1.0" in line
    debug = run_train_py("--data.alpha=-1", f"--federation.output_dir={tmp_path}", FL_LIGHTNING_DEBUG="1")
    assert debug.returncode == 1 and "Traceback" in debug.stderr  # the switch gives the whole traceback


def test_only_errors_before_the_first_round_are_shortened():
    def raised_in(function):
        try:
            function()
        except ValueError as err:
            return err

    def run_round():
        raise ValueError("in a round")

    def setup():
        raise ValueError("before training")

    assert cli._while_training(raised_in(run_round)) and not cli._while_training(raised_in(setup))


def test_a_method_refusing_its_setting_at_the_first_fit_is_one_line_too(tmp_path):
    proc = run_train_py("--trainer.callbacks+=callbacks.DPSGD", "--trainer.callbacks.target_epsilon=0.0001",
                        "--model.init_args.norm=group", f"--federation.output_dir={tmp_path}")  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert any(line.startswith("error: DPSGD target_epsilon=0.0001 cannot be reached") for line in
               proc.stderr.splitlines())  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "where"),
    [
        (["--config", "configs/fedavg_camelyon17.yaml"],
         "configs/fedavg_camelyon17.yaml (model.init_args.net.class_path): monai.networks.nets.DenseNet121"),
        (["--config", "configs/fedavg_digits.yaml", "--model.net=monai.networks.nets.DenseNet121"],
         "the command line (--model.net): monai.networks.nets.DenseNet121"),
    ],
)  # fmt: skip
def test_a_recipe_needing_a_missing_extra_says_which_to_install_in_one_line(monkeypatch, capsys, argv, where):
    """Failed before: a 60-line usage dump with "No module named 'monai'" buried in it."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setitem(sys.modules, "monai", None)  # as if the medical extra were not installed
    assert cli.command(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {where} needs the 'monai' package")
    assert "install the medical extra: pip install -e '.[medical]'" in err


def test_a_config_including_another_is_searched_too_and_installed_extras_pass(tmp_path):
    from fl_lightning.startup.extras import missing_extra

    (tmp_path / "base.yaml").write_text("model:\n  init_args:\n    net:\n      class_path: flwr_absent_pkg.Net\n")
    (tmp_path / "top.yaml").write_text("config: base.yaml\ntrainer:\n  callbacks:\n    - class_path: ray.X\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "ray", None)
        assert missing_extra(["--config", str(tmp_path / "top.yaml")]) == (
            f"{tmp_path / 'top.yaml'} (trainer.callbacks[0].class_path): ray.X needs the 'ray' package, which is not "
            "installed: install the flower-sim extra: pip install -e '.[flower-sim]'"
        )
    assert missing_extra(["--config", "configs/fedavg_camelyon17.yaml"]) is None  # monai is installed here
    assert missing_extra(["--config", str(tmp_path / "base.yaml")]) is None  # not an extra's module: the parser's


def test_reading_nifti_without_nibabel_names_the_file_and_the_extra(monkeypatch, tmp_path):
    from datamodules.volumes import read_volume

    monkeypatch.setitem(sys.modules, "nibabel", None)
    with pytest.raises(ModuleNotFoundError, match=r"case0\.nii\.gz needs nibabel.*install the medical extra"):
        read_volume(tmp_path / "case0.nii.gz")
