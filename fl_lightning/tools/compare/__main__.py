"""``python -m fl_lightning.tools.compare RUN_DIR [RUN_DIR ...]``: runs :func:`fl_lightning.tools.compare.cli.main`."""

from fl_lightning.tools.compare.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
