"""Local fine-tuning (FedAvg+): each client fine-tunes the federated model on its own data before testing."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from callbacks.base import FederatedCallback
from datamodules.sampler import SeededEpochSampler, stable_seed
from fl_lightning.errors import PreconditionError
from fl_lightning.ops import clone_state

if TYPE_CHECKING:
    from fl_lightning.callback import ClientContext, ServerView

MODEL_NAME = "finetuned"


class LocalFineTuning(FederatedCallback):
    """FedAvg+: after federated training, each client fine-tunes its model for ``epochs`` local epochs.

    The federated run itself is untouched; at the final evaluation (at every evaluation with
    ``every_eval``) each client with a test set starts from the model it is evaluated with as
    ``personal`` (its group's global state plus its private state), trains ``epochs`` epochs on its own
    training data with the client module's own optimiser (fresh, as the module configures it) through
    the shared Trainer, and is tested on its test set. The results are reported as the model
    ``finetuned`` next to ``global`` and ``personal`` (``eval/finetuned/*``, ``summary.json``).
    ``epochs=0`` trains nothing, so ``finetuned`` equals ``personal`` exactly (and ``global`` for FedAvg).

    Fine-tuning leaves no trace on the run: the module's weights, the global RNG states and the
    Trainer's callback list are restored afterwards, the clients' persistent training samplers do not
    advance (fine-tuning shuffles with its own sampler, seeded from ``(data seed, client, "finetune")``,
    so every fine-tuning of a client sees the same batches), and kept optimiser states are not used.
    The other federated callbacks are detached from the Trainer while fine-tuning, so it is plain local
    training whatever the method (no FedProx term, SCAFFOLD correction or MOON term). The optimiser is
    built as the module builds it now: under a learning-rate schedule (``callbacks.LRSchedule``) the
    module's ``lr_factor`` of the round just trained stays in effect, i.e. fine-tuning continues at
    the last round's learning rate.

    A client in several sample-level groups (sample-clustered FL) fine-tunes the model its ``global``
    and ``personal`` evaluations use (its first group's) on all its training data, with a warning.
    A client whose fine-tuning fit fails is left out of ``finetuned`` with a warning. Only federated
    star-topology runs are accepted (``on_federation_start`` names ``federation.mode``/``topology``).

    Messages: one ``finetune`` query task per client with a test set, carrying its group's global state;
    the client fine-tunes on its own runtime and replies with its test metrics only.

    Args:
        epochs: Local fine-tuning epochs k ≥ 0 (k = 0 ⇒ FedAvg).
        every_eval: Fine-tune at every evaluation (``federation.eval_every``), not only the final one.

    Raises:
        ValueError: If ``epochs`` is negative.

    """

    def __init__(self, epochs: int = 1, every_eval: bool = False) -> None:
        super().__init__()
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"LocalFineTuning epochs must be an integer >= 0, got {epochs!r}")
        self.epochs, self.every_eval = epochs, every_eval
        self._warned_multi_group = False

    @override
    def on_federation_start(self, server: ServerView) -> None:
        cfg = server.config
        # (The Federation already refuses any federated callback outside federated mode; this names the reason.)
        if cfg.mode != "federated":
            raise ValueError(
                f"LocalFineTuning needs federation.mode=federated, got federation.mode={cfg.mode}: "
                "fine-tuning after local or centralised training is not the FedAvg+ baseline"
            )
        if cfg.topology != "star":
            raise ValueError(
                f"LocalFineTuning needs federation.topology=star, got {cfg.topology}: "
                "peer-to-peer runs have no global model to fine-tune"
            )

    # ------------------------------------------------------------------ server half
    @override
    def extra_evaluation(self, server: ServerView) -> dict[str, dict[str, dict[str, float]]]:
        # During run_round(r) server.round is still r, so the final round's evaluation has round + 1 == rounds;
        # an evaluation after the run (round == rounds) is of the final model too.
        if not self.every_eval and server.round + 1 < server.config.rounds:
            return {}
        results: dict[str, dict[str, float]] = {}
        split = server.eval_split  # val on evaluation rounds with a validation split; test at the end
        count = server.data.num_val_samples if split == "val" else server.data.num_test_samples
        for cid in server.data.client_ids:
            if not count(cid):
                continue
            group = server.group_of(cid)
            self._warn_if_in_several_groups(server, cid)
            payload = {"epochs": self.epochs, "split": split}
            answer = server.query(self, "finetune", [cid], payload, group=group.name, state=group.state)[cid]
            if answer["error"] is not None:
                warnings.warn(
                    f"fine-tuning of client {cid!r} failed; left out of {MODEL_NAME!r}: {answer['error']}", stacklevel=2
                )
            else:
                results[cid] = answer["metrics"]
        return {MODEL_NAME: results}

    def _warn_if_in_several_groups(self, server: ServerView, client_id: str) -> None:
        groups = [g.name for g in server.groups if client_id in g.members]
        if len(groups) > 1 and not self._warned_multi_group:
            self._warned_multi_group = True
            warnings.warn(
                f"client {client_id!r} trains in several sample-level groups {groups}; LocalFineTuning fine-tunes "
                f"the model of {groups[0]!r} (the one its global/personal evaluation uses) on all its data",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ client half
    @override
    def answer_query(self, ctx: ClientContext, name: str, payload: Any) -> Any:
        if name != "finetune":
            return super().answer_query(ctx, name, payload)
        module = ctx.module
        saved = clone_state(module.state_dict())
        try:  # the runtime runs every task under generators seeded for it and restored after (ops.rng.seeded_rng)
            return self.fine_tune(ctx, int(payload["epochs"]), str(payload["split"]))
        finally:
            module.load_state_dict(saved)

    def fine_tune(self, ctx: ClientContext, epochs: int, split: str = "test") -> dict[str, Any]:
        """Load the client's model, train it ``epochs`` epochs on its training data, evaluate it on ``split``.

        Returns:
            ``{"metrics": metrics on split (test or val), "error": None}``, or ``{"metrics": None, "error": reason}``
            if the fit failed.

        """
        cid, module, data, device = ctx.client_id, ctx.module, ctx.data, ctx.device
        # What the "personal" evaluation loads (the group's global state with the client's private state).
        module.load_state_dict({**ctx.received, **ctx.private})
        if epochs:
            n = data.num_train_samples(cid)
            # Its own sampler: the client's persistent one (federated training's shuffling) must not advance.
            sampler = SeededEpochSampler(n, stable_seed(data.seed, cid, "finetune"))
            loader = data.client_subset_train_loader(cid, torch.arange(n), sampler)
            try:  # plain local training of the final model: a fresh optimiser, no method's callback acting on it
                ctx.fit_alone(loader, epochs)
            except PreconditionError:
                raise
            except Exception as err:  # noqa: BLE001 - one client's failure must not end the run
                return {"metrics": None, "error": repr(err)}
        module.to(device)  # a strategy other than the fitter's resident one moves it to the CPU after a fit
        return {"metrics": module.evaluate(data.client_eval_loader(cid, split), device), "error": None}
