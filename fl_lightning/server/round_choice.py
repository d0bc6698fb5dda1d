"""The server's model selection over a run: validation rounds in, the chosen round's models kept, test read once.

With a validation split on the clients, evaluation rounds score the validation sets only; :class:`RoundChoice`
enters each into a :class:`~fl_lightning.server.model_selection.Selection`, keeps the best round's group states
(and has every client copy its private states, a ``keep`` task) under ``federation.select: best``, tells when
``federation.patience`` ends the run, and after the last round evaluates the test sets: the chosen round's models
and, when that is not the last round, the last round's too. Nothing here ever reads a test metric to decide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fl_lightning.callback import ModelGroup
from fl_lightning.ops import clone_state
from fl_lightning.server.model_selection import (
    Selection,
    available_monitors,
    default_monitor,
    monitored_value,
    parse_monitor,
)
from fl_lightning.wire import protocol
from fl_lightning.wire.protocol import KEPT, Task

if TYPE_CHECKING:
    from fl_lightning.server.core import Server


class RoundChoice:
    """The chosen round of a run with a validation split (see the module docstring).

    Args:
        server: The server (its config, groups, clients, transport and evaluation).
        has_private: Whether the clients hold private states the evaluation loads (they are kept with the round).

    Raises:
        ValueError: For a monitor that is not a validation metric (``federation.monitor``).
    """

    def __init__(self, server: Server, has_private: bool) -> None:
        cfg = server.config
        self.select, self.patience, self.has_private = cfg.select, cfg.patience, has_private
        text = cfg.monitor or default_monitor(server.module.primary_metric, server.has_global_model)
        self.selection = Selection(parse_monitor(text))
        self.best_groups: list[ModelGroup] | None = None  # the best round's groups (select: best)
        self.last_round_test: dict[str, Any] = {}  # the last round's test evaluation, when another round is chosen
        self.last_val_summary: dict[str, Any] = {}  # the last validation evaluation's summary

    @classmethod
    def of(cls, server: Server, has_private: bool) -> RoundChoice | None:
        """The run's choice, or None without a validation split (where only ``select: last`` is valid).

        Raises:
            ValueError: For ``select: best``, ``patience`` or ``monitor`` without a validation split.
        """
        cfg = server.config
        if server.has_validation:
            return cls(server, has_private)
        asked = [k for k, on in (("select=best", cfg.select == "best"), ("patience", cfg.patience is not None),
                                 ("monitor", cfg.monitor is not None)) if on]  # fmt: skip
        if asked:
            raise ValueError(
                f"federation.{', federation.'.join(asked)} chooses on a validation split, and the clients have none: "
                "set data.init_args.val_fraction (e.g. 0.1), or remove the setting (choosing the round on test "
                "metrics would report a tuned test score)"
            )
        return None

    # ------------------------------------------------------------------ during the rounds
    def record(self, server: Server, r: int, evaluation: dict[str, Any]) -> dict[str, Any]:
        """Enter round ``r``'s (0-based) validation evaluation; keep its models if best; its ``rounds.csv`` entries.

        Raises:
            ValueError: If the evaluation does not hold the monitored metric (naming the ones it holds).
        """
        selection = self.selection
        value = monitored_value(evaluation, selection.monitor)
        if value is None:
            raise ValueError(
                f"federation.monitor={selection.monitor.text!r} is not in round {r + 1}'s validation evaluation; "
                f"it holds {', '.join(available_monitors(evaluation)) or 'nothing'}"
            )
        if selection.update(r + 1, value):
            selection.best_summary = evaluation.get("summary", {})
            if self.select == "best":
                self.keep(server)
        return {"select/value": value, "select/best_round": selection.best_round}

    def keep(self, server: Server) -> None:
        """Keep the groups' states and have every client copy its private states: the best round so far."""
        self.best_groups = [ModelGroup(g.name, clone_state(g.state), list(g.members), g.subsets) for g in server.groups]
        if self.has_private:
            tasks = [Task(protocol.KEEP, server.round, cid) for cid in server.data.client_ids]
            for _ in server.transport.stream(tasks):
                pass

    def stop_reason(self) -> str | None:
        """Why the run ends before its next round (``federation.patience`` spent), else None."""
        return self.selection.stop_reason(self.patience)

    @property
    def chosen_round(self) -> int | None:
        """The round whose models are reported: the best under ``select: best``, else None (the last one)."""
        return self.selection.best_round if self.select == "best" and self.best_groups is not None else None

    # ------------------------------------------------------------------ the end
    def final_test(self, server: Server, last_validation: dict[str, Any]) -> dict[str, Any]:
        """Evaluate the test sets once: the chosen round's models, and the last round's if that is another.

        Args:
            server: The server, after its last round.
            last_validation: The last round's validation evaluation.

        Returns:
            The chosen round's test evaluation (what ``summary.json`` reports).
        """
        self.last_val_summary = last_validation.get("summary", {})
        last = server.evaluate(split="test")
        chosen = self.chosen_round
        if chosen is None or chosen == server.round:
            self.last_round_test = {}
            return last
        current = server.groups
        # under their KEPT names the clients evaluate their kept private states with the kept group states
        server.groups = [ModelGroup(KEPT + g.name, g.state, g.members, g.subsets) for g in self.best_groups or []]
        try:
            chosen_test = server.evaluate(split="test")
        finally:
            server.groups = current
        self.last_round_test = last
        return chosen_test

    def summary_entries(self, rounds_run: int) -> dict[str, Any]:
        """``summary.json``'s ``selection`` (how the round was chosen) and, if another, ``last_round``'s test."""
        selection = self.selection
        chosen = self.chosen_round or rounds_run
        out: dict[str, Any] = {
            "selection": {
                "select": self.select,
                "monitor": selection.monitor.text,
                "round": chosen,
                "value": dict(selection.history).get(chosen),
                "split": "val",
                "best_round": selection.best_round,
                "best_value": selection.best_value,
                "validation": selection.best_summary if chosen == selection.best_round else self.last_val_summary,
                "test_evaluated": sorted({chosen, rounds_run}),
            }
        }
        if self.last_round_test:
            last = self.last_round_test
            out["last_round"] = {"round": rounds_run, "summary": last["summary"]}
            if "pooled" in last:
                out["last_round"]["pooled"] = last["pooled"]
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint entry: the selection and, under ``select: best``, the best round's groups."""
        groups = None
        if self.best_groups is not None:
            groups = [{"name": g.name, "state": g.state, "members": list(g.members), "subsets": g.subsets}
                      for g in self.best_groups]  # fmt: skip
        return {**self.selection.state_dict(), "groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.selection.load_state_dict(state)
        groups = state.get("groups")
        self.best_groups = None if groups is None else [
            ModelGroup(g["name"], g["state"], list(g["members"]), g.get("subsets")) for g in groups
        ]  # fmt: skip
