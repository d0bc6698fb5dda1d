"""MkDocs hook: pages made at build time from the project itself, so they cannot go stale.

- ``reference/config.md``: the config reference, from the CLI's parser (:mod:`fl_lightning.tools.config_reference`).
- ``experiments/<study>/README.md`` and the figures under ``experiments/results/``: each study's page is the
  README beside its script, shown as it is in the repository.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]


def config_sections() -> dict:
    """Every config section with every class that may fill it: the clients, datamodules and methods shipped."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import callbacks
    import datamodules
    from datamodules.base import FederatedDataModule
    from fl_lightning import clients
    from fl_lightning.callback import FederatedCallback
    from fl_lightning.clients.base import ClientModule
    from fl_lightning.tools.config_reference import sections

    def exported(module: object, base: type) -> list[type]:
        found = [getattr(module, name) for name in module.__all__]
        return [c for c in found if isinstance(c, type) and issubclass(c, base) and c is not base]

    return sections(
        exported(clients, ClientModule),
        exported(datamodules, FederatedDataModule),
        exported(callbacks, FederatedCallback),
    )


def on_files(files: Files, config) -> Files:  # noqa: ANN001 - MkDocs' hook signature
    """Add the generated reference and the studies' READMEs and figures to the site's files."""
    from fl_lightning.tools.config_reference import reference_markdown

    files.append(File.generated(config, "reference/config.md", content=reference_markdown(config_sections())))
    experiments = REPO / "experiments"
    results = sorted(p for p in experiments.glob("results/**/*") if p.is_file())
    for path in sorted(experiments.glob("*/README.md")) + results:
        uri = path.relative_to(REPO).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
