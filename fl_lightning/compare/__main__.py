"""``python -m fl_lightning.compare RUN_DIR [RUN_DIR ...]``: runs :func:`fl_lightning.compare.cli.main`."""

from fl_lightning.compare.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
