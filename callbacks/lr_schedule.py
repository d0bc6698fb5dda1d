"""LRSchedule: the local learning rate decays over federated rounds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from typing_extensions import override

from callbacks.base import FederatedCallback
from callbacks.preconditions import single_optimizer
from fl_lightning.errors import PreconditionError
from fl_lightning.ops.lr_schedule import check_schedule_args, lr_factor

if TYPE_CHECKING:
    from fl_lightning.callback import RuntimeView, ServerView
    from fl_lightning.wire.protocol import Task


class LRSchedule(FederatedCallback):
    """Decays the clients' local learning rate over the federated rounds: η_r = model.lr · factor(r).

    The server puts the factor of the running round r (0-based) of R = ``federation.rounds`` in every
    ``fit`` task's budget (``task.lr_factor``); the client runtime sets the module's ``lr_factor`` to it
    before the local fit, and the module's optimiser is built with ``model.lr · lr_factor``, so every
    client of a round trains with the same η_r:

    - ``constant``: 1 (the schedule does nothing)
    - ``exponential``: γ^r
    - ``step``: γ^⌊r / step_size⌋
    - ``cosine``: min_factor + (1 − min_factor)(1 + cos(π r / R)) / 2
    - ``poly``: (1 − r / R)^power

    Every kind is floored at ``min_factor``. The factor depends on the round index only, so the decay
    simply continues when a method splits the model into groups (ClusteredFL, DomainIsolation: "the
    learning-rate decay continues from T_s") and after resuming from a checkpoint (no state to save;
    resume with the same ``federation.rounds`` for ``cosine`` and ``poly``). It also holds with
    ``federation.keep_optimizer_state``: a kept optimiser state brings back its buffers (momentum,
    Adam moments), never an old learning rate. SCAFFOLD's control variates use the round's η_r.

    Example (YAML)::

        trainer:
          callbacks:
            - class_path: callbacks.LRSchedule
              init_args: {kind: exponential, gamma: 0.95}

    Args:
        kind: Factor of round r (0-based) of R = federation.rounds: ``constant`` (1), ``exponential`` (γ^r),
            ``step`` (γ^⌊r / step_size⌋), ``cosine`` (from 1 down towards min_factor) or ``poly`` ((1 − r/R)^power).
        gamma: Decay γ ∈ (0, 1] per round (``exponential``) or per step of ``step_size`` rounds (``step``).
        step_size: Rounds per step of ``step``, ≥ 1.
        power: Exponent of ``poly``, > 0.
        min_factor: Lower bound of the factor, in [0, 1] (where ``cosine`` ends).

    """

    def __init__(
        self,
        kind: Literal["constant", "exponential", "step", "cosine", "poly"] = "exponential",
        gamma: float = 0.97,
        step_size: int = 10,
        power: float = 0.9,
        min_factor: float = 0.0,
    ) -> None:
        super().__init__()
        try:
            check_schedule_args(kind, gamma, step_size, power, min_factor)
        except ValueError as err:
            raise ValueError(f"LRSchedule {err}") from None
        self.kind, self.gamma, self.step_size, self.power, self.min_factor = kind, gamma, step_size, power, min_factor

    def factor(self, round_idx: int, total_rounds: int) -> float:
        """The learning-rate factor of round ``round_idx`` (0-based) of ``total_rounds``."""
        return lr_factor(
            self.kind,
            round_idx,
            total_rounds,
            gamma=self.gamma,
            step_size=self.step_size,
            power=self.power,
            min_factor=self.min_factor,
        )

    @override
    def on_runtime_start(self, runtime: RuntimeView) -> None:
        module = runtime.module
        if not hasattr(module, "lr_factor"):
            raise PreconditionError(
                f"LRSchedule needs a client module with an lr_factor attribute (a ClientModule), got {type(module)}"
            )
        # The factor only acts through configure_optimizers: check it really scales the learning rate.
        module.lr_factor = 1.0
        base = [group["lr"] for group in single_optimizer(module, "LRSchedule").param_groups]
        module.lr_factor = 0.5
        halved = [group["lr"] for group in single_optimizer(module, "LRSchedule").param_groups]
        module.lr_factor = 1.0
        if any(abs(h - 0.5 * b) > 1e-12 * abs(b) for b, h in zip(base, halved, strict=True)):
            raise PreconditionError(
                f"LRSchedule: {type(module).__name__}.configure_optimizers ignores lr_factor "
                "(build the optimiser with lr = hparams.lr * self.lr_factor)"
            )

    @override
    def configure_task(self, server: ServerView, task: Task) -> None:
        task.lr_factor = self.factor(task.round, server.config.rounds)
