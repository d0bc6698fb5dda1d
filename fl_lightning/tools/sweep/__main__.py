"""``python -m fl_lightning.tools.sweep``: runs :func:`fl_lightning.tools.sweep.cli.main`."""

from fl_lightning.tools.sweep.cli import command

if __name__ == "__main__":
    raise SystemExit(command())
