"""Exceptions with a meaning for the round manager."""


class PreconditionError(ValueError):
    """A method cannot work with this model, optimiser or Trainer setting.

    Raised by callbacks (usually in ``on_federation_start``); the Federation never treats it as one
    client's failure, it stops the run before (or as soon as) it would train.
    """
