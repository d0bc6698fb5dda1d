"""The docs say what exists: every command shown parses, every path, config and class path named exists."""

import contextlib
import importlib
import importlib.util
import io
import json
import re
import shlex
import warnings
from pathlib import Path

import pytest

from fl_lightning.cli import build_cli
from fl_lightning.tools.config_reference import class_entries, undocumented

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "experiments").glob("*/README.md"))]
SOURCES = sorted(p for pkg in ("fl_lightning", "callbacks", "datamodules") for p in (REPO / pkg).rglob("*.py"))
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# Values for the shell variables of the docs' loops (the comparing-methods tutorial).
SHELL_VARS = {"$seed": "0", "${method}": "fedavg"}


def code_blocks(text: str) -> list[str]:
    """The shell blocks of a Markdown text (fences tagged bash, sh, console or untagged; others are skipped whole)."""
    blocks = re.findall(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    return [body for tag, body in blocks if tag in ("", "bash", "sh", "console", "shell")]


def train_commands() -> list[tuple[str, list[str]]]:
    """``(where, arguments)`` of every ``python train.py …`` line in a code block of the README or the docs.

    ``python -m fl_lightning.stats …`` lines too: the statistics command is ``train.py`` with ``mode=stats``.
    """
    found = []
    for doc in DOCS:
        for block in code_blocks(doc.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                stats = line.startswith("python -m fl_lightning.stats")
                if not (line.startswith("python train.py") or stats) or "<" in line or "…" in line or "$A" in line:
                    continue
                for var, value in SHELL_VARS.items():
                    line = line.replace(var, value)
                args = shlex.split(line, comments=True)[3 if stats else 2 :]
                args += ["--federation.mode=stats"] if stats else []
                found.append((doc.relative_to(REPO).as_posix(), args))
    return found


COMMANDS = train_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) > 20, COMMANDS


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[f"{w}:{' '.join(a)[:60]}" for w, a in COMMANDS])
def test_every_train_command_in_the_docs_parses(where, args):
    """The CLI parses it: ``--print_config`` checks every key and value without training (``--help`` prints)."""
    extra = [] if "--help" in args or "--print_config" in args else ["--print_config"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        build_cli([*args, *extra])
    assert stop.value.code in (0, None), (where, args, out.getvalue()[-2000:])


PATH = re.compile(
    r"(?<![\w/.])((?:configs|callbacks|fl_lightning|datamodules|experiments|benchmarks|tests|docs)/[\w./-]*\w\.(?:py|yaml|md|json|png|txt))"
)
CONFIG_NAME = re.compile(r"(?<![\w/.{])(\w+_(?:digits|medmnist)\w*\.yaml)")
CLASS_PATH = re.compile(r"(?<![\w./])((?:callbacks|datamodules|fl_lightning)(?:\.\w+)+)")


def mentions(pattern: re.Pattern) -> list[tuple[str, str]]:
    out = set()
    for path in [*DOCS, *SOURCES, *CONFIGS]:
        text = path.read_text()
        out.update((path.relative_to(REPO).as_posix(), m) for m in pattern.findall(text))
    return sorted(out)


def test_every_file_path_named_in_docs_docstrings_and_configs_exists():
    def exists(where: str, p: str) -> bool:  # a docs page's link may be relative to its page
        return any((base / p).exists() for base in (REPO, (REPO / where).parent, REPO / "docs")) or "*" in p

    assert [(where, p) for where, p in mentions(PATH) if not exists(where, p)] == []


def test_every_config_named_exists():
    missing = [(where, c) for where, c in mentions(CONFIG_NAME) if not (REPO / "configs" / c).exists()]
    assert missing == []


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute chain under one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_class_path_named_resolves():
    # a build artefact, a test's own unknown path, and two names that are not modules: the Flower Array's stype
    # tag of our messages and a logger's name
    skip = ("fl_lightning.egg", "fl_lightning.no_such_module", "fl_lightning.message", "fl_lightning.flower_worker")
    with warnings.catch_warnings():  # the moved-modules table names old paths: they resolve, with their warning
        warnings.filterwarnings("ignore", r".* moved to .*; import it from there", DeprecationWarning)
        missing = [(where, d) for where, d in mentions(CLASS_PATH) if not d.startswith(skip) and not resolves(d)]
    assert missing == []


def test_the_checks_can_fail(tmp_path):
    assert not resolves("callbacks.NoSuchMethod") and resolves("callbacks.FedProx")
    assert PATH.findall("see `configs/feddyn_digits.yaml` and fl_lightning/cli.py") == [
        "configs/feddyn_digits.yaml", "fl_lightning/cli.py"
    ]  # fmt: skip
    assert not (REPO / "configs/feddyn_digits.yaml").exists()


def config_sections() -> dict:
    """The docs build's sections (``docs/hooks/generated.py``: every client, datamodule and method shipped)."""
    spec = importlib.util.spec_from_file_location("docs_hook", REPO / "docs" / "hooks" / "generated.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook.config_sections()


def test_every_config_key_has_a_docstring():
    parts = config_sections()
    assert {"federation", "model", "data", "trainer.callbacks"} <= set(parts) and len(parts["trainer.callbacks"]) > 15
    assert undocumented(parts) == []


def test_an_argument_without_a_docstring_is_found():
    class Undocumented:
        def __init__(self, documented: int = 1, silent: float = 0.5) -> None:
            """A class.

            Args:
                documented: Says something.
            """

    entries = {e.key: e.help for e in class_entries(Undocumented, "x.")}
    assert entries["x.documented"] == "Says something." and entries["x.silent"] == ""


def test_every_column_and_key_a_run_writes_is_documented(tmp_path):
    from fl_lightning.cli import main

    main(["--config", "configs/fedbn_digits.yaml", "--trainer.logger=false", "--federation.rounds=1",
          "--federation.progress=false", "--federation.plots=false", "--data.max_samples_per_client=20",
          "--data.image_size=8", "--model.width=4", f"--federation.output_dir={tmp_path}",
          "--federation.run_name=r"])  # fmt: skip
    page = (REPO / "docs" / "reference" / "run-directory.md").read_text()
    run = tmp_path / "r"
    names = set()
    for csv_name in ("metrics.csv", "rounds.csv"):
        names.update((run / csv_name).read_text().splitlines()[0].split(","))
    names.update(json.loads((run / "summary.json").read_text()))
    metric_names = {
        n.rsplit("/", 1)[-1] for n in names if "/" in n and n.split("/")[0] in ("global", "personal", "eval")
    }
    plain = {n for n in names if not n.startswith(("global/", "personal/", "eval/"))}
    missing = sorted(n for n in plain | metric_names if f"`{n}`" not in page and f"`{n}," not in page)
    assert missing == []


# ------------------------------------------------------------------------------------------------ deployment commands
GUIDE = REPO / "docs" / "how-to" / "across-sites.md"
FLOWER_PROGRAMS = ("flwr", "flower-superlink", "flower-supernode")
OUR_TOOLS = ("fl_lightning.tools.app_signing", "fl_lightning.tools.app_registry")
# Not ours and not Python: the guide's certificate and key commands (OpenSSL, OpenSSH) and plain shell.
SYSTEM_PROGRAMS = ("openssl", "ssh-keygen", "printf", "cat", "mkdir", "mv")


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, heredoc bodies, comments, ``&&`` chains, a
    trailing ``&`` and leading ``VAR=value`` assignments taken apart (what the shell itself would run)."""
    out, heredoc = [], None
    for line in block.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if m := re.search(r"<<'?(\w+)'?", line):
            heredoc, line = m.group(1), line[: m.start()]
        for part in re.split(r"\s&&\s", line):
            words = shlex.split(part, comments=True)
            if ">" in words:  # a redirection: the command is what comes before it
                words = words[: words.index(">")]
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words and words[-1] == "&":
                words = words[:-1]
            if words:
                out.append(words)
    return out


def guide_commands(doc: Path) -> list[list[str]]:
    return [words for block in code_blocks(doc.read_text()) for words in shell_commands(block)]


_HELP: dict[tuple[str, ...], str] = {}


def help_text(program: list[str]) -> str:
    """``program --help`` (wide, no colours), once per program."""
    import os
    import subprocess
    import sys

    key = tuple(program)
    if key not in _HELP:
        exe = (
            [sys.executable, *program[1:]]
            if program[0] == "python"
            else [str(Path(sys.executable).parent / program[0]), *program[1:]]
        )
        env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
        run = subprocess.run([*exe, "--help"], capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, (program, run.stderr[-2000:])
        _HELP[key] = run.stdout
    return _HELP[key]


def flower_subcommand(words: list[str]) -> list[str]:
    """``flwr run …`` → ``[flwr, run]``; ``flwr supernode register …`` → ``[flwr, supernode, register]``."""
    if words[0] != "flwr":
        return words[:1]
    n = 2 if len(words) > 2 and words[1] in ("supernode", "app", "federation") else 1
    return words[: 1 + n]


def check_command(words: list[str]) -> None:
    """Fail unless ``words`` parse: our tools by their own parser, Flower's by the options its --help lists."""
    if words[:2] == ["python", "-m"] and words[2] in OUR_TOOLS:
        module = importlib.import_module(words[2])
        try:
            module.build_parser().parse_args(words[3:])
        except SystemExit as stop:
            raise AssertionError(f"{' '.join(words)}: {words[2]} refuses its arguments") from stop
        return
    if words[0] in FLOWER_PROGRAMS or words[:3] == ["python", "-m", "fl_lightning.engines.flower_worker"]:
        program = words[:3] if words[0] == "python" else flower_subcommand(words)
        text = help_text(program)
        for word in words[len(program) :]:
            if word.startswith("-"):
                option = word.split("=")[0]
                assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), f"{' '.join(program)}: no {option}"
        return
    if words[:2] == ["python", "train.py"] or words[:3] == ["python", "-m", "fl_lightning.stats"]:
        return  # test_every_train_command_in_the_docs_parses
    assert words[0] in SYSTEM_PROGRAMS, f"the guide runs {words[0]!r}, which no test parses"


def test_every_command_of_the_across_sites_guide_parses():
    commands = guide_commands(GUIDE)
    programs = {" ".join(flower_subcommand(w)) if w[0] != "python" else " ".join(w[:3]) for w in commands}
    # the walk from keys to a signed app to a finished run
    walk = {"flwr build", "python -m fl_lightning.tools.app_signing", "python -m fl_lightning.tools.app_registry",
            "flower-superlink", "flower-supernode", "flwr supernode register", "flwr run"}  # fmt: skip
    assert walk <= programs, programs
    assert any("--trusted-entities" in w for w in commands) and any(
        w[:3] == ["flwr", "run", "@fl-lightning/fl-lightning==0.1.0"] for w in commands
    )
    for words in commands:
        check_command(words)


def test_every_flower_command_of_the_docs_parses():
    starts = (*(f"{p} " for p in FLOWER_PROGRAMS), *(f"python -m {t} " for t in OUR_TOOLS))
    found = 0
    for doc in DOCS:
        for block in code_blocks(doc.read_text()) if doc != GUIDE else []:  # (not every untagged block is shell)
            lines = [line for line in block.replace("\\\n", " ").splitlines() if line.strip().startswith(starts)]
            for words in shell_commands("\n".join(lines)):
                check_command(words)
                found += 1
    assert found, "the README shows `flwr run`"


def test_the_command_checks_can_fail():
    with pytest.raises(AssertionError, match="no --no-such-option"):
        check_command(["flower-supernode", "--no-such-option", "x"])
    with pytest.raises(AssertionError, match="refuses its arguments"):
        check_command(["python", "-m", "fl_lightning.tools.app_signing", "sign", "x.fab"])  # no --key
    with pytest.raises(AssertionError, match="which no test parses"):
        check_command(["curl", "https://example.org"])
    assert shell_commands("A=1 B=2 flwr run . x &\ncat <<'T'\nnot a command\nT\nmkdir a && mv b c  # why\n") == [
        ["flwr", "run", ".", "x"], ["cat"], ["mkdir", "a"], ["mv", "b", "c"],
    ]  # fmt: skip
