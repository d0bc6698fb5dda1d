"""Importing Lightning defers scipy.signal past torchmetrics, and leaves no trace of the placeholder behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from fl_lightning.startup import lean_imports

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, pythonpath: Path | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (this one has torchmetrics loaded already); it prints one JSON line."""
    env_path = [str(pythonpath)] if pythonpath else []
    code = f"import sys; sys.path[:0] = {env_path!r}\n" + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lightning_loads_without_scipy_signal_and_the_real_module_loads_afterwards() -> None:
    got = _run(
        """
        import json, types
        import fl_lightning
        import lightning.pytorch
        from fl_lightning.startup import lean_imports
        result = {
            "torchmetrics": "torchmetrics" in sys.modules,
            "signal_after_lightning": "scipy.signal" in sys.modules,
            "finder_left": any(isinstance(f, lean_imports._TorchmetricsFinder) for f in sys.meta_path),
        }
        import scipy
        import scipy.signal
        from torchmetrics.functional.audio import signal_noise_ratio  # an audio metric module loads as before
        # no module kept a reference to the placeholder: every module named scipy.signal is SciPy's
        placeholders = [
            name for name, module in list(sys.modules.items()) if module is not None
            for value in list(vars(module).values())
            if isinstance(value, types.ModuleType) and value.__name__ == "scipy.signal" and value is not scipy.signal
        ]
        result.update(
            real=sys.modules["scipy.signal"] is scipy.signal and scipy.signal is vars(scipy)["signal"],
            butter=callable(getattr(scipy.signal, "butter", None)),
            placeholders=placeholders,
        )
        print(json.dumps(result))
        """
    )
    assert got["torchmetrics"]
    assert not got["signal_after_lightning"], "importing Lightning still imports scipy.signal"
    assert not got["finder_left"]
    assert got["real"] and got["butter"]
    assert got["placeholders"] == []


def test_a_torchmetrics_that_needs_scipy_signal_while_loading_loads_with_the_real_one(tmp_path: Path) -> None:
    """A version using more of scipy.signal at import than the alias: imported again with SciPy's module."""
    package = tmp_path / "torchmetrics"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import scipy.signal\nfrom torchmetrics import sub\nBUTTER = scipy.signal.butter\n"
    )
    (package / "sub.py").write_text("import scipy.signal\nHAS_BUTTER = hasattr(scipy.signal, 'butter')\n")
    got = _run(
        """
        import json
        import fl_lightning
        import torchmetrics
        import scipy.signal
        print(json.dumps({
            "fake": torchmetrics.__file__.startswith(sys.path[0]),
            "butter": torchmetrics.BUTTER is scipy.signal.butter,
            "sub": torchmetrics.sub.HAS_BUTTER,
            "real": sys.modules["scipy.signal"] is scipy.signal,
        }))
        """,
        pythonpath=tmp_path,
    )
    assert got == {"fake": True, "butter": True, "sub": True, "real": True}


def test_the_placeholder_alias_is_scipys_hamming_window() -> None:
    from scipy.signal import windows

    np.testing.assert_array_equal(lean_imports._hamming(7, sym=False), windows.hamming(7, sym=False))


def test_install_does_nothing_once_torchmetrics_is_loaded() -> None:
    import torchmetrics  # noqa: F401 - the state install() checks

    before = list(sys.meta_path)
    lean_imports.install()
    assert sys.meta_path == before


def test_the_workaround_is_for_the_torchmetrics_releases_of_the_issue_only() -> None:
    assert lean_imports.affected("1.9.0") and lean_imports.affected("1.8.2") and lean_imports.affected("1.9.1.post1")
    assert not lean_imports.affected("1.10.0") and not lean_imports.affected("2.0.0rc1")
    assert not lean_imports.affected("dev")


def test_a_torchmetrics_release_after_the_last_affected_one_gets_no_workaround() -> None:
    # What "fixed upstream" looks like: a newer torchmetrics; importing Lightning then loads scipy.signal as usual.
    got = _run(
        """
        import importlib.metadata as metadata, json
        real = metadata.version
        metadata.version = lambda name: "1.10.0" if name == "torchmetrics" else real(name)
        from fl_lightning.startup import lean_imports  # importing fl_lightning runs install()
        import lightning.pytorch
        finder = any(isinstance(f, lean_imports._TorchmetricsFinder) for f in sys.meta_path)
        print(json.dumps({"signal": "scipy.signal" in sys.modules, "finder": finder}))
        """
    )
    assert got == {"signal": True, "finder": False}
