"""``long_lived``: no cyclic collection inside the block, everything alive frozen after it, the collector as before."""

from __future__ import annotations

import gc

import pytest

from fl_lightning.startup.heap import import_long_lived, long_lived


@pytest.fixture(autouse=True)
def _restore_collector():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


@pytest.mark.parametrize("enabled", [True, False])
def test_long_lived_pauses_the_collector_then_freezes_and_restores_it(enabled: bool):
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()
    with long_lived():
        assert not gc.isenabled()
        kept = [[] for _ in range(1000)]  # created inside: frozen afterwards
    assert gc.isenabled() is enabled
    assert gc.get_freeze_count() >= len(kept)
    tracked = {id(o) for o in gc.get_objects()}  # the collector's generations (frozen objects are not in them)
    assert not any(id(x) in tracked for x in kept)


def test_long_lived_restores_the_collector_when_the_block_raises():
    gc.enable()
    with pytest.raises(RuntimeError, match="boom"), long_lived():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_import_long_lived_imports_the_modules_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch):
    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr("importlib.import_module", lambda name: seen.append((name, gc.isenabled())))
    gc.enable()
    import_long_lived("a.b", "c")
    assert seen == [("a.b", False), ("c", False)]
    assert gc.isenabled()
