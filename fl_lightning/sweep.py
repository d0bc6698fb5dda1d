"""``python -m fl_lightning.sweep``: the short name of the sweep command, :mod:`fl_lightning.tools.sweep`.

The other commands are ``python -m fl_lightning.tools.<name>``; the issue that asked for sweeps names this one
``fl_lightning.sweep``, and both paths run the same :func:`fl_lightning.tools.sweep.cli.main`.
"""

from fl_lightning.tools.sweep.cli import command

if __name__ == "__main__":
    raise SystemExit(command())
