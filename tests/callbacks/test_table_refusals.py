"""Image-only methods (HarmoFL's amplitude layer, FedER, Deep Domain Isolation) refuse tables before training."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from callbacks import AmplitudeNormalization, DomainIsolation, ExperienceReplay
from callbacks.base import FederatedCallback
from callbacks.preconditions import refuse_tables
from datamodules import ClinicalTableFederated
from fl_lightning.cli import command
from fl_lightning.clients import TabularClient
from fl_lightning.errors import PreconditionError
from fl_lightning.server.directory import ClientDirectory
from tests.callbacks.tables import table_args, write_table
from tests.conftest import tiny_data, tiny_model

TABLE = "datamodules.clinical_table.ClinicalTableFederated"
FIX = "use it with image data or remove it from trainer.callbacks"
# (config name, the callback, its class path and init args in a config)
METHODS = [
    ("callbacks.AmplitudeNormalization", AmplitudeNormalization, {}),
    ("callbacks.ExperienceReplay (FedER)", ExperienceReplay, {}),
    ("callbacks.DomainIsolation", DomainIsolation, {"split_round": 1}),
]


def _refusal(method: str, data_class: str = TABLE) -> str:
    return f"{method} works on images: the data ({data_class}) are a table (sample_kind='table'); {FIX}"


class _Rows:
    """Another datamodule of tables: only its public ``sample_kind`` says so."""

    sample_kind = "table"


def test_refuse_tables_reads_the_public_sample_kind(tmp_path: Path) -> None:
    """A table is refused with its class, kind and the fix; images and a server's client directory pass.

    A deployment's server holds a ClientDirectory (no ``sample_kind``): it cannot tell, its clients' runtimes do.
    """
    table = ClinicalTableFederated(write_table(tmp_path / "table"), categorical_columns=["cp"])
    with pytest.raises(PreconditionError, match=re.escape(_refusal("callbacks.X"))):
        refuse_tables(table, "callbacks.X")
    rows = f"{__name__}._Rows"
    with pytest.raises(ValueError, match=re.escape(_refusal("callbacks.Y", rows))):
        refuse_tables(_Rows(), "callbacks.Y")
    refuse_tables(tiny_data(), "callbacks.X")
    refuse_tables(ClientDirectory({"a": 3}, {"a": 1}, batch_size=2), "callbacks.X")


@pytest.mark.parametrize(("method", "cls", "args"), METHODS, ids=lambda v: v if isinstance(v, str) else "")
def test_image_method_refuses_a_table_where_it_is_prepared(
    method: str, cls: type[FederatedCallback], args: dict, tmp_path: Path
) -> None:
    """``prepare_module`` (each side's first look at the data) refuses a table and takes images."""
    table = ClinicalTableFederated(write_table(tmp_path / "table"), categorical_columns=["cp"])
    callback = cls(**args)
    with pytest.raises(PreconditionError, match=re.escape(_refusal(method))):
        callback.prepare_module(TabularClient(num_features=table.num_features), table)
    images = tiny_data()
    callback.prepare_module(tiny_model(images), images)


@pytest.mark.parametrize(("method", "cls", "args"), METHODS, ids=lambda v: v if isinstance(v, str) else "")
def test_train_py_stops_before_training_with_the_refusal(
    method: str, cls: type[FederatedCallback], args: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through ``train.py``'s command: one error line naming the method and the fix, exit status 2, no round run.

    The refusal comes before the methods' own checks of the topology (FedER needs peer-to-peer, the run is a star):
    it is the one the user must act on.
    """
    callback = {"class_path": f"callbacks.{cls.__name__}", "init_args": args}
    argv = table_args(tmp_path, "refused", trainer={"callbacks": [callback]})

    assert command(argv) == 2

    assert f"error: {_refusal(method)}" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "refused" / "rounds.csv").exists()
