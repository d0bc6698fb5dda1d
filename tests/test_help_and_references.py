"""``--help`` documents every federation setting, and the configs' comments name files that exist."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from fl_lightning.cli import build_cli
from fl_lightning.config import FederationConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def help_text() -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_cli(["--help"])
    return out.getvalue()


def option_help(text: str, option: str) -> str:
    """The help of ``--<option>`` without the option line's choices and the ``(type: …, default: …)`` tail."""
    match = re.search(rf"^  --{re.escape(option)}\b(.*?)(?=^  -|\Z)", text, flags=re.M | re.S)
    assert match, f"--{option} is not in --help"
    body = match.group(1).split("\n", 1)[-1] if "\n" in match.group(1) else ""
    return re.sub(r"\(type: .*?default: .*?\)", "", " ".join(body.split()), flags=re.S).strip()


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(FederationConfig)])
def test_every_federation_setting_has_help(help_text: str, field: str) -> None:
    described = option_help(help_text, f"federation.{field}")
    assert len(described.split()) >= 3, f"--federation.{field} has no description in --help: {described!r}"


def test_quiet_and_auto_progress_are_settings() -> None:
    cfg = FederationConfig()
    assert cfg.progress is None and cfg.quiet is False


CONFIG_REF = re.compile(r"configs/[\w.-]+\.yaml")


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_config_files_name_only_configs_that_exist(path: Path) -> None:
    text = path.read_text()
    named = set(CONFIG_REF.findall(text))
    named |= {f"configs/{m}" for m in re.findall(r"^config:\s*([\w.-]+\.yaml)", text, flags=re.M)}
    missing = sorted(n for n in named if not (REPO / n).is_file())
    assert not missing, f"{path.name} names configs that do not exist: {missing}"
