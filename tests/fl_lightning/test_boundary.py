"""The client/server boundary: one-way imports, refused compositions, transports that agree, bytes counted."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from callbacks import FedBN, FedNova, FedOpt, FedProx, Scaffold
from fl_lightning import protocol
from tests.conftest import build_federation

REPO = Path(__file__).resolve().parents[2]
# The data layer's base interface, which the core may use (never a specific dataset).
DATA_BASE = {"datamodules.base", "datamodules.sampler", "datamodules.files", "datamodules.generated"}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at top level or inside functions (``from x import y`` counts as ``x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def violations(package: str, allowed: callable) -> list[str]:
    out = []
    for path in sorted((REPO / package).rglob("*.py")):
        out += [f"{path.relative_to(REPO)} imports {m}" for m in sorted(imports_of(path)) if not allowed(m)]
    return out


def ours(module: str) -> bool:
    return module.split(".")[0] in ("fl_lightning", "callbacks", "datamodules")


def test_the_core_imports_no_method_and_no_specific_dataset():
    def allowed(m):
        return not m.startswith("callbacks") and (not m.startswith("datamodules") or m in DATA_BASE)

    assert violations("fl_lightning", allowed) == []


def test_datamodules_import_nothing_of_ours_but_themselves():
    assert violations("datamodules", lambda m: not ours(m) or m.startswith("datamodules")) == []


def test_the_client_side_never_imports_the_server():
    for name in ("runtime.py", "transport.py", "protocol.py"):
        assert "fl_lightning.federation" not in imports_of(REPO / "fl_lightning" / name), name


def test_the_walk_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from callbacks.scaffold import Scaffold\n")
    assert "callbacks.scaffold" in imports_of(bad)


# ---------------------------------------------------------------- composition


@pytest.mark.parametrize(
    ("callbacks", "names"),
    [
        (lambda: [FedNova(), FedOpt()], ("FedNova", "FedOpt")),
        (lambda: [Scaffold(), FedNova()], ("Scaffold", "FedNova")),
    ],
)
def test_two_server_steps_are_refused_naming_both(tmp_path, callbacks, names):
    with pytest.raises(ValueError, match=f"{names[0]} and {names[1]} both replace the server step"):
        build_federation(tmp_path, callbacks())


def test_the_same_method_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="FedProx.*more than once"):
        build_federation(tmp_path, [FedProx(mu=0.1), FedProx(mu=0.2)])


# ---------------------------------------------------------------- transports


def test_serialized_runtime_holds_its_own_copies_and_agrees_bit_for_bit(tmp_path):
    runs = {}
    for transport in ("inprocess", "serialized"):
        fed = build_federation(tmp_path / transport, [FedBN(), FedProx(mu=0.1)], rounds=2, transport=transport)
        runs[transport] = (fed, fed.run())
    fed, _ = runs["serialized"]
    assert fed.runtime.module is not fed.module and fed.runtime.data is not fed.data
    assert not set(map(id, fed.runtime.callbacks)) & set(map(id, fed.callbacks))
    assert fed.runtime.trainer is not fed.trainer
    (a, sa), (b, sb) = runs["inprocess"], runs["serialized"]
    for k, v in a.groups[0].state.items():
        assert torch.equal(v, b.groups[0].state[k]), k
    assert a.private.keys() == b.private.keys()
    for key, state in a.private.items():
        assert all(torch.equal(v, b.private[key][k]) for k, v in state.items()), key
    assert sa["summary"] == sb["summary"] and sa["pooled"] == sb["pooled"]
    # the server's own module never trained: only messages crossed
    init = build_federation(tmp_path / "init", [FedBN(), FedProx(mu=0.1)])
    assert all(torch.equal(v, init.module.state_dict()[k]) for k, v in fed.module.state_dict().items())


def comm(fed) -> tuple[int, int]:
    row = fed.run_dir.round_rows[-1]
    return row["comm/bytes_down"], row["comm/bytes_up"]


@pytest.mark.parametrize("transport", ["inprocess", "serialized"])
def test_fedavg_uploads_one_model_per_trained_client_and_scaffold_about_two(tmp_path, transport):
    fedavg = build_federation(tmp_path / "a", rounds=1, transport=transport)
    fedavg.run()
    model_bytes = sum(v.numel() * v.element_size() for v in fedavg.groups[0].state.values())
    trained = len(fedavg.data.client_ids)
    down, up = comm(fedavg)
    # per message, on top of the tensors: the JSON description of each tensor (name, dtype, shape) and a few numbers
    header = 120 * len(fedavg.groups[0].state) + 512
    assert trained * model_bytes < up < trained * (model_bytes + header)
    assert trained * model_bytes < down < trained * (model_bytes + header)
    scaffold = build_federation(tmp_path / "s", [Scaffold()], rounds=1, transport=transport)
    scaffold.run()
    ratio = comm(scaffold)[1] / up
    assert 1.6 < ratio < 2.1, ratio  # the model and Δc_i (the trainable parameters only)


def test_the_counts_are_the_encoded_sizes(tmp_path):
    fed = build_federation(tmp_path, rounds=1)
    fed.setup()
    task = fed.fit_task(0, fed.groups[0], fed.data.client_ids[0])
    assert protocol.encoded_size(task) == len(protocol.encode(task))
    before = fed.transport.bytes_down
    fed.transport.request(task)
    assert fed.transport.bytes_down - before == len(protocol.encode(task))
