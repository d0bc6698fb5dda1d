"""Exceptions with a meaning for the round manager."""


class PreconditionError(ValueError):
    """A method cannot work with this model, optimiser or Trainer setting.

    Raised by callbacks (usually in ``on_federation_start``); the Federation never treats it as one
    client's failure, it stops the run before (or as soon as) it would train.
    """


class StopFederation(Exception):  # noqa: N818 - a signal, not an error: the run ends normally
    """Raised by a callback's ``on_round_start`` to end the run before that round (e.g. a privacy budget is spent).

    A normal end, not a failure: the rounds done so far stand; the Federation warns with the message, evaluates
    the last models if that round was not evaluated, checkpoints them and writes ``summary.json`` with
    ``stopped`` = the message. Raise it from ``on_round_start`` only (before any task of the round is sent).
    """


class RankError(RuntimeError):
    """A rank of a distributed run died, hung past the timeout, or failed; the message names it."""


class MissingExtra(ImportError):
    """A config or a loader needs a package of an optional extra that is not installed; the message says which."""
