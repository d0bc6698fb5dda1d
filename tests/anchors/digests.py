"""Bit-for-bit digests of every shipped config's final state (tiny data, two rounds) and of the anchor runs.

For a refactor: write the digests on the commit before it, check them after, on the same machine
(digests of float states differ across CPU kernels, so they are never stored in the repository).

    python -m tests.anchors.digests --write before.json
    python -m tests.anchors.digests --check before.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from fl_lightning.cli import main
from tests.anchors.runs import RUNS, describe, run_args
from tests.test_configs import CONFIGS, tiny_args


def digests(out: Path) -> dict[str, dict]:
    """Run every config and anchor run under ``out``; per run its states' sha256 and its summary's numbers."""
    found = {}
    for config in CONFIGS:
        main(tiny_args(config, out / "configs", config.stem))
        found[f"config/{config.stem}"] = describe(out / "configs" / config.stem)
    for name in RUNS:
        main(run_args(name, out / "anchors"))
        found[f"anchor/{name}"] = describe(out / "anchors" / name)
    return {k: {"sha256": v["sha256"], "summary": v["summary"]} for k, v in found.items()}


def what_differs(want: dict | None, got: dict | None) -> str:
    """Which part of a run's digest differs: its final states, or which summary entries (added, gone, changed)."""
    if want is None or got is None:
        return "run only in " + ("this check" if want is None else "the written digests")
    parts = [] if want["sha256"] == got["sha256"] else ["final states"]
    w, g = want["summary"], got["summary"]
    added, gone = sorted(g.keys() - w.keys()), sorted(w.keys() - g.keys())
    changed = sorted(k for k in w.keys() & g.keys() if w[k] != g[k])
    for label, keys in (("summary entries added", added), ("gone", gone), ("changed", changed)):
        if keys:
            parts.append(f"{label} {keys[:6]}{' …' if len(keys) > 6 else ''}")
    return "; ".join(parts) or "nothing (equal)"


def main_(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--check", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        got = digests(Path(tmp))
    if args.write:
        args.write.write_text(json.dumps(got, indent=1, sort_keys=True))
        print(f"{len(got)} runs written to {args.write}")
        return 0
    want = json.loads(args.check.read_text())
    differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    for k in differ:
        print(f"DIFFERS {k}: {what_differs(want.get(k), got.get(k))}")
    print(f"{len(want) - len(differ)} of {len(want)} runs identical bit for bit")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main_())
