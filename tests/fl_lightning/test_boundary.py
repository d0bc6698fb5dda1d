"""The client/server boundary: one-way imports, refused compositions, transports that agree, bytes counted."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from callbacks import FedBN, FedNova, FedOpt, FedProx, Scaffold
from fl_lightning.wire import protocol
from tests.conftest import build_federation

REPO = Path(__file__).resolve().parents[2]
# The data layer's base interface, which the core may use (never a specific dataset).
DATA_BASE = {"datamodules.base", "datamodules.sampler", "datamodules.files", "datamodules.generated"}
# Method code shared by every method (not one method's): the base class's re-export and the precondition checks.
SHARED = {"callbacks", "callbacks.base", "callbacks.preconditions"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def known_modules() -> set[str]:
    return {module_name(p) for pkg in ("fl_lightning", "callbacks", "datamodules") for p in (REPO / pkg).rglob("*.py")}


def imports_of(path: Path, modules: set[str] | None = None) -> set[str]:
    """Every module a file imports, at top level, inside functions or for type hints only.

    ``from x import y`` counts as ``x.y`` when that is one of ``modules`` (a submodule), else as ``x``.
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{a.name}" for a in node.names} & (modules or set())
            found.update(subs or {node.module})
            if len(subs) < len(node.names):
                found.add(node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    """Our modules and, for each, the modules of ours it imports."""
    modules = known_modules()
    graph = {}
    for pkg in ("fl_lightning", "callbacks", "datamodules"):
        for path in (REPO / pkg).rglob("*.py"):
            graph[module_name(path)] = {m for m in imports_of(path, modules) if m in modules}
    return graph


def violations(package: str, allowed: callable) -> list[str]:
    out = []
    for path in sorted((REPO / package).rglob("*.py")):
        out += [f"{path.relative_to(REPO)} imports {m}" for m in sorted(imports_of(path)) if not allowed(m)]
    return out


def ours(module: str) -> bool:
    return module.split(".")[0] in ("fl_lightning", "callbacks", "datamodules")


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_core_imports_no_method_and_no_specific_dataset():
    def allowed(m):
        return not m.startswith("callbacks") and (not m.startswith("datamodules") or m in DATA_BASE)

    assert violations("fl_lightning", allowed) == []


def test_datamodules_import_nothing_of_ours_but_themselves():
    assert violations("datamodules", lambda m: not ours(m) or m.startswith("datamodules")) == []


def test_the_contract_and_the_wire_import_neither_the_server_nor_the_runtime():
    sides = ("fl_lightning.server", "fl_lightning.runtime", "fl_lightning.engines", "fl_lightning.outputs")
    contract = {
        m: deps for m, deps in import_graph().items() if m == "fl_lightning.callback" or under(m, "fl_lightning.wire")
    }
    bad = [f"{m} imports {i}" for m, deps in contract.items() for i in sorted(deps) if under(i, *sides)]
    assert bad == []


def test_the_server_imports_no_runtime_and_no_engine_not_even_through_another_module():
    graph = import_graph()
    assert "fl_lightning.server.federation" in graph
    bad = []
    for module in (m for m in graph if under(m, "fl_lightning.server")):
        seen, todo = set(), [module]
        while todo:  # every module the server's module loads, directly or through others (type hints included)
            for dep in graph[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        bad += [
            f"{module} reaches {m}" for m in sorted(seen) if under(m, "fl_lightning.runtime", "fl_lightning.engines")
        ]
    assert bad == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or v in graph.get(v, ()):
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_core_modules_counting_type_hints():
    core = {
        m: {d for d in deps if under(d, "fl_lightning")}
        for m, deps in import_graph().items()
        if under(m, "fl_lightning")
    }
    assert cycles(core) == []


def test_the_cycle_finder_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def method_of(module: str) -> str | None:
    """``callbacks.<file>`` or ``callbacks.<folder>``: which method a module of ``callbacks/`` belongs to."""
    if not module.startswith("callbacks.") or module in SHARED:
        return None
    return module.split(".")[1]


def owners(graph: dict[str, set[str]]) -> dict[str, str | None]:
    """Per core module, the one method that alone uses it (directly or through core modules only it uses), else None.

    A module nothing imports (a command, an engine's entry point) belongs to no method.
    """
    importers = {m: {u for u, deps in graph.items() if m in deps and u != m} for m in graph}
    memo: dict[str, str | None] = {}

    def owner(m: str, path: frozenset[str]) -> str | None:
        if m in memo:
            return memo[m]
        found = set()
        for user in importers[m]:
            if user.startswith("callbacks"):
                found.add(method_of(user) or "shared")
            elif user.startswith("fl_lightning") and user not in path:
                found.add(owner(user, path | {m}) or "core")
        result = found.pop() if len(found) == 1 and "core" not in found and "shared" not in found else None
        if not path:
            memo[m] = result
        return result

    return {m: owner(m, frozenset()) for m in graph if m.startswith("fl_lightning.")}


def test_the_core_holds_no_module_used_by_only_one_method():
    # ops/ is the exception by design: each method's pure maths, tested without a Trainer
    found = {m: o for m, o in owners(import_graph()).items() if o is not None and not under(m, "fl_lightning.ops")}
    assert found == {}


def test_the_owner_finder_can_fail():
    graph = {"fl_lightning.gan": set(), "fl_lightning.helper": {"fl_lightning.gan"}, "callbacks.feder.x": {
        "fl_lightning.helper"}, "fl_lightning.shared": set(), "callbacks.a": {"fl_lightning.shared"},
        "callbacks.b": {"fl_lightning.shared"}}  # fmt: skip
    assert owners(graph) == {"fl_lightning.gan": "feder", "fl_lightning.helper": "feder", "fl_lightning.shared": None}


# What a method file may import of ours: the contract (callback.py and its errors), the messages, ops/, models/, the
# callbacks' shared checks, the data layer's base, and its own folder. DDI's nested federation (a federation per
# cluster, server and runtimes included) is the one exception; FedER's privacy audit is a command that reads a run
# directory, not a method file.
METHOD_MAY_IMPORT = ("fl_lightning.callback", "fl_lightning.errors", "fl_lightning.wire.protocol", "fl_lightning.ops",
                     "fl_lightning.models")  # fmt: skip
NESTED_FEDERATION = {"callbacks.ddi.cluster_selector", "callbacks.ddi.domain_isolation"}
COMMANDS = {"callbacks.feder.privacy_audit"}


def method_import_breaches(graph: dict[str, set[str]]) -> list[str]:
    """``<method module> imports <module>`` for every import a method file may not make."""
    found = []
    for module, deps in sorted(graph.items()):
        if not module.startswith("callbacks") or module in SHARED | NESTED_FEDERATION | COMMANDS:
            continue
        for dep in sorted(deps):
            own_folder = method_of(dep) is not None and method_of(dep) == method_of(module)
            if not (under(dep, *METHOD_MAY_IMPORT) or dep in SHARED or dep in DATA_BASE or own_folder):
                found.append(f"{module} imports {dep}")
    return found


def test_method_files_import_only_the_contract_messages_ops_models_and_shared_checks():
    assert method_import_breaches(import_graph()) == []


def test_the_method_import_rule_can_fail():
    graph = {"callbacks.fedx": {"fl_lightning.callback", "fl_lightning.server.selection", "callbacks.scaffold"},
             "callbacks.feder.a": {"callbacks.feder.b", "fl_lightning.ops.replay", "datamodules.sampler"},
             "callbacks.ddi.cluster_selector": {"fl_lightning.server.federation"}}  # fmt: skip
    assert method_import_breaches(graph) == [
        "callbacks.fedx imports callbacks.scaffold",
        "callbacks.fedx imports fl_lightning.server.selection",
    ]


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
    assert fed.transport.runtime.module is not fed.module and fed.transport.runtime.data is not fed.data
    assert not set(map(id, fed.transport.runtime.callbacks)) & set(map(id, fed.callbacks))
    assert fed.transport.runtime.trainer is not fed.trainer
    (a, sa), (b, sb) = runs["inprocess"], runs["serialized"]
    for k, v in a.groups[0].state.items():
        assert torch.equal(v, b.groups[0].state[k]), k
    assert a.transport.private.keys() == b.transport.private.keys()
    for key, state in a.transport.private.items():
        assert all(torch.equal(v, b.transport.private[key][k]) for k, v in state.items()), key
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


def test_one_pooled_client_id_on_both_layers():
    from datamodules.base import POOLED_KEY
    from fl_lightning.wire.protocol import POOLED

    # the data layer imports nothing of ours, so it names its sampler key itself: the same id
    assert POOLED_KEY == POOLED


# ---------------------------------------------------------------------------------------------- Lightning's contract
SOURCES = ("fl_lightning", "callbacks", "datamodules", "experiments", "train.py")
# Lightning hooks, which Lightning calls: a call of one of them by us would run it outside Lightning's loop.
LIGHTNING_HOOKS = {"on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
                   "on_train_batch_start", "on_train_batch_end", "on_fit_start", "on_fit_end", "setup_optimizers",
                   "on_before_backward", "on_after_backward", "on_before_optimizer_step"}  # fmt: skip


# Private names of other packages we still read, each with its reason (a new one fails the test).
FOREIGN_PRIVATE_ALLOWED = {
    # The docs build's config reference lists every key the parser knows; jsonargparse (like argparse) offers no
    # public list of a parser's arguments. Only the docs build runs it, never a training run.
    ("fl_lightning/tools/config_reference.py", "_actions"),
}


def source_files() -> list[Path]:
    paths = [REPO / s for s in SOURCES]
    return sorted(p for path in paths for p in ([path] if path.is_file() else path.rglob("*.py")))


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_names(paths: list[Path]) -> set[str]:
    """The private names our code defines: functions, classes, variables, arguments, ``self._x``/``cls._x``."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
    return {n for n in names if is_private(n)}


def foreign_private_reads(paths: list[Path], own: set[str]) -> list[str]:
    """Private names of other packages read or imported (``logger._experiment``, ``from torch.x._utils import y``)."""
    found = []
    for path in paths:
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in own:
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr == "_exit" or (str(where), node.attr) in FOREIGN_PRIVATE_ALLOWED:
                    continue  # os._exit: checked on its own
                found.append(f"{where}:{node.lineno}: reads the private {node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level and not ours(node.module):
                names = [*node.module.split("."), *(a.name for a in node.names)]
                if any(is_private(n) for n in names):
                    found.append(f"{where}:{node.lineno}: imports a private name from {node.module}")
    return found


def contract_breaches(paths: list[Path]) -> list[str]:
    """Assignments to ``__class__`` or a ``training_step``, hooks called by hand, ``os._exit``, and private names of
    other packages (CPython, Lightning, torch, W&B ...) read or imported.

    ``os._exit`` is allowed only in ``local_ranks.py``: the launcher's failure path (rank 0 blocked for good).
    """
    found = []
    for path in paths:
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in ("__class__", "training_step"):
                        found.append(f"{where}:{node.lineno}: assigns {t.attr}")
            elif isinstance(node, ast.Attribute):
                if node.attr == "_exit" and path.name != "local_ranks.py":
                    found.append(f"{where}:{node.lineno}: os._exit")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value  # super().hook(...) inside an override is Lightning's own call going on
                is_super = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
                if node.func.attr in LIGHTNING_HOOKS and not is_super:
                    found.append(f"{where}:{node.lineno}: calls the hook {node.func.attr} by hand")
    found += foreign_private_reads(paths, own_private_names(source_files()))
    return sorted(found, key=lambda b: (b.split(":")[0], int(b.split(":")[1])))


def test_nothing_forks_lightning_or_reads_private_names_of_other_packages():
    assert contract_breaches(source_files()) == []
    for gone in ("fl_lightning/runtime/round_fit.py", "fl_lightning/startup/quick_exit.py",
                 "fl_lightning/startup/lean_wandb.py", "fl_lightning/startup/early_ranks.py"):  # fmt: skip
        assert not (REPO / gone).exists(), gone


def test_one_function_launches_local_ranks():
    # Popen of a rank and multiprocessing's spawn: only in the launcher (torchrun, Flower and Ray start their own).
    launchers = []
    for path in source_files():
        text = path.read_text()
        if "subprocess.Popen(" in text and "RANK" in text or "start_processes(" in text or "mp.spawn(" in text:
            launchers.append(str(path.relative_to(REPO)))
    assert launchers == ["fl_lightning/engines/local_ranks.py"]


def test_the_contract_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import atexit, os\n"
        "strategy.__class__ = Other\n"
        "module.training_step = step\n"
        "n = atexit._ncallbacks()\n"
        "os._exit(0)\n"
        "from torch.utils.data._utils.collate import default_collate\n"
        "callback.on_train_start(trainer, module)\n"
        "super().on_train_start(trainer, module)\n"
    )
    breaches = contract_breaches([bad])
    assert [b.split(": ", 1)[1] for b in breaches] == [
        "assigns __class__", "assigns training_step", "reads the private _ncallbacks", "os._exit",
        "imports a private name from torch.utils.data._utils.collate", "calls the hook on_train_start by hand",
    ]  # fmt: skip
