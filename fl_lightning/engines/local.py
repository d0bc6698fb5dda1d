"""The transports of one process: ``inprocess`` (direct calls) and ``serialized`` (every message as bytes).

``inprocess`` calls the runtime directly (no copies on the hot path; the byte counts are what the encoding
*would* take, computed without encoding). ``serialized`` encodes every task and reply to bytes and decodes
them, and its runtime holds its own module, data and callbacks: a run that works with it sends nothing
across the boundary but messages.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from fl_lightning.outputs.report import RoundReporter
from fl_lightning.runtime import ClientRuntime
from fl_lightning.server.federation import Federation
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import Reply, Task
from fl_lightning.wire.transport import Transport

if TYPE_CHECKING:
    import lightning as L

    from datamodules.base import FederatedDataModule
    from fl_lightning.config import FederationConfig
    from fl_lightning.ops.state import StateDict


class LocalTransport(Transport):
    """A transport whose client runtime lives in this process; tests and benchmarks may look into it.

    Args:
        runtime: The client runtime that hosts every client.
    """

    def __init__(self, runtime: ClientRuntime) -> None:
        super().__init__()
        self.runtime = runtime

    @override
    def prepare(self) -> None:
        self.runtime.prepare()

    @override
    def start(self, workdir: Any) -> None:
        self.runtime.start(workdir)

    @override
    def runtime_state(self) -> dict[str, Any]:
        return self.runtime.state_dict()

    @override
    def load_runtime_state(self, state: dict[str, Any]) -> None:
        self.runtime.load_state_dict(state)

    @property
    def private(self) -> dict[tuple[str, str], StateDict]:
        """The runtime's private states keyed ``(group, client)``."""
        return {(g, c): st for c, groups in self.runtime.private.items() for g, st in groups.items()}

    @property
    def optimizer_states(self) -> dict[tuple[str, str], dict[str, Any]]:
        """The runtime's kept optimiser states keyed ``(group, client)``."""
        return {(g, c): st for c, groups in self.runtime.optimizer_states.items() for g, st in groups.items()}


class InProcessTransport(LocalTransport):
    """Direct calls: the task's tensors are the server's own (the runtime copies what it loads)."""

    name = "inprocess"

    @override
    def request(self, task: Task) -> Reply:
        return next(self.stream([task]))

    @override
    def stream(self, tasks: list[Task]) -> Iterator[Reply]:
        self.bytes_down += sum(protocol.encoded_size(task) for task in tasks)
        for reply in self.runtime.handle_many(tasks):
            self.bytes_up += protocol.encoded_size(reply)
            yield reply


class SerializedTransport(LocalTransport):
    """Every task and reply is encoded to bytes and decoded on the other side (and so is checkpoint state)."""

    name = "serialized"

    @override
    def request(self, task: Task) -> Reply:
        return next(self.stream([task]))

    @override
    def stream(self, tasks: list[Task]) -> Iterator[Reply]:
        messages = [protocol.encode(task) for task in tasks]
        self.bytes_down += sum(len(data) for data in messages)
        for answer in self.runtime.handle_many_bytes(messages):
            self.bytes_up += len(answer)
            yield protocol.decode(answer)

    @override
    def runtime_state(self) -> dict[str, Any]:
        return protocol.decode(protocol.encode(self.runtime.state_dict()))

    @override
    def load_runtime_state(self, state: dict[str, Any]) -> None:
        self.runtime.load_state_dict(protocol.decode(protocol.encode(state)))


TRANSPORTS: dict[str, type[LocalTransport]] = {"inprocess": InProcessTransport, "serialized": SerializedTransport}


def build_transport(
    config: FederationConfig,
    module: L.LightningModule,
    data: FederatedDataModule,
    trainer: L.Trainer,
    seed: int,
    note: Callable[[str], None] | None = None,
    runtime_factory: Callable[[], ClientRuntime] | None = None,
) -> LocalTransport:
    """The transport ``config.transport`` names, with its client runtime.

    ``inprocess``: one module, data and Trainer for both sides (the server prepares the module, the runtime
    reuses it). ``serialized``: the runtime ``runtime_factory`` builds (the CLI instantiates the config again), or
    deep copies taken now, before the server touches anything.

    Raises:
        ValueError: For an unknown transport, naming the key.
    """
    kind = config.transport
    if kind not in TRANSPORTS:
        raise ValueError(f"federation.transport must be one of {sorted(TRANSPORTS)}, got {kind!r}")
    if kind == "inprocess":
        runtime = ClientRuntime(module, data, trainer, config, seed, prepared=True, note=note)
    elif runtime_factory is not None:
        runtime = runtime_factory()
    else:
        runtime = ClientRuntime(
            copy.deepcopy(module), copy.deepcopy(data), copy.deepcopy(trainer), config, seed, note=note
        )
    return TRANSPORTS[kind](runtime)


def local_federation(
    config: FederationConfig,
    module: L.LightningModule,
    datamodule: FederatedDataModule,
    trainer: L.Trainer,
    seed: int = 0,
    runtime_factory: Callable[[], ClientRuntime] | None = None,
    **kwargs: Any,
) -> Federation:
    """A :class:`~fl_lightning.server.federation.Federation` over the transport ``config.transport`` names.

    Args:
        config: The ``federation:`` settings.
        module: The client module template (in process, also the runtime's module).
        datamodule: The clients' data.
        trainer: The Trainer; its federated callbacks define the method.
        seed: The run's seed.
        runtime_factory: Builds the ``serialized`` transport's runtime (default: deep copies).
        **kwargs: Further :class:`~fl_lightning.server.federation.Federation` arguments (``reporter``,
            ``config_text``, ``config_dict``).
    """
    reporter = kwargs.pop("reporter", None) or RoundReporter.from_config(config)
    transport = build_transport(config, module, datamodule, trainer, seed, reporter.note, runtime_factory)
    return Federation(config, module, datamodule, trainer, transport, seed=seed, reporter=reporter, **kwargs)
