"""The clients' states beside the round checkpoints: written only when changed, read back whole, pruned safely."""

from pathlib import Path

import pytest
import torch

from fl_lightning.outputs.checkpoint import (
    checkpoint_path,
    find_last_checkpoint,
    load_checkpoint,
    save_checkpoint,
    write_round_checkpoint,
)
from fl_lightning.outputs.client_store import DIGESTS_KEY, FILES_KEY, STORE_DIR, ClientStateStore, expand


def runtime(generations: dict[str, int], value: float = 0.0) -> dict:
    """A runtime state with a SCAFFOLD-like c_i and a private layer per client."""
    return {
        "private": {c: {"global": {"bn.weight": torch.full((2,), value + g)}} for c, g in generations.items()},
        "optimizer_states": {},
        "callback_states": {c: {"Scaffold": {"c_i": torch.full((3,), float(g))}} for c, g in generations.items()},
        "subset_samplers": {},
        "data": {c: 0 for c in generations},
        "generations": dict(generations),
    }


def store_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints" / STORE_DIR).iterdir())


def save(run_dir: Path, store: ClientStateStore, round_idx: int, state: dict, keep: int = 0) -> dict:
    path = checkpoint_path(run_dir, round_idx)
    write_round_checkpoint(path, {"round": round_idx, "runtime": state}, store, keep)
    return torch.load(path, weights_only=True)["runtime"]  # as written: file names, not states


def test_only_changed_clients_are_written_and_a_load_gives_the_full_state(tmp_path):
    store = ClientStateStore()
    first = save(tmp_path, store, 1, runtime({"a": 1, "b": 1, "c": 0}))
    assert len(set(first[FILES_KEY].values())) == 1 and sorted(first[FILES_KEY]) == ["a", "b", "c"]
    assert first["private"] == {} and first["callback_states"] == {}  # the states are in the file, not inline

    second = save(tmp_path, store, 2, runtime({"a": 2, "b": 1, "c": 0}))  # only "a" answered a task since
    assert len(store_files(tmp_path)) == 2
    new_file = second[FILES_KEY]["a"]
    assert new_file != first[FILES_KEY]["a"] and second[FILES_KEY]["b"] == first[FILES_KEY]["b"]
    assert list(torch.load(tmp_path / "checkpoints" / STORE_DIR / new_file, weights_only=True)) == ["a"]

    unchanged = save(tmp_path, store, 3, runtime({"a": 2, "b": 1, "c": 0}))
    assert unchanged[FILES_KEY] == second[FILES_KEY] and len(store_files(tmp_path)) == 2  # nothing new to write

    loaded = load_checkpoint(checkpoint_path(tmp_path, 2))["runtime"]
    expected = runtime({"a": 2, "b": 1, "c": 0})
    for key in ("private", "callback_states"):
        assert loaded[key].keys() == expected[key].keys()
        for cid in expected[key]:
            for cb, state in expected[key][cid].items():
                for name, tensor in state.items():
                    assert torch.equal(loaded[key][cid][cb][name], tensor), (key, cid, name)
    assert FILES_KEY not in loaded and loaded["generations"] == expected["generations"]


def test_a_mostly_superseded_file_has_its_live_clients_copied_and_is_pruned(tmp_path):
    store = ClientStateStore()
    ids = {c: 0 for c in "abcd"}
    first = save(tmp_path, store, 1, runtime(ids), keep=1)
    old = first[FILES_KEY]["a"]
    save(tmp_path, store, 2, runtime({**ids, "a": 1}), keep=1)  # 3 of 4 still live in the first file: it stays
    assert old in store_files(tmp_path)
    third = save(tmp_path, store, 3, runtime({**ids, "a": 1, "b": 1, "c": 1}), keep=1)  # 1 of 4 live: copied on
    assert old not in third[FILES_KEY].values()
    assert old not in store_files(tmp_path)  # no kept checkpoint names it any more
    assert set(store_files(tmp_path)) == set(third[FILES_KEY].values())


def test_pruning_keeps_what_a_kept_older_checkpoint_names(tmp_path):
    store = ClientStateStore()
    first = save(tmp_path, store, 1, runtime({"a": 0, "b": 0}), keep=2)
    save(tmp_path, store, 2, runtime({"a": 1, "b": 1}), keep=2)
    assert first[FILES_KEY]["a"] in store_files(tmp_path)  # round 1 is kept, so is its file
    save(tmp_path, store, 3, runtime({"a": 2, "b": 2}), keep=2)
    assert first[FILES_KEY]["a"] not in store_files(tmp_path)  # round 1 pruned: its file goes with it
    assert load_checkpoint(checkpoint_path(tmp_path, 2))["runtime"]["generations"] == {"a": 1, "b": 1}

    # A fresh store (a resumed run) reads the kept checkpoints it did not write before deleting anything.
    fresh = ClientStateStore()
    save(tmp_path, fresh, 4, runtime({"a": 3, "b": 2}), keep=3)
    for round_idx in (2, 3, 4):
        assert load_checkpoint(checkpoint_path(tmp_path, round_idx))["round"] == round_idx


def test_a_missing_state_file_is_named(tmp_path):
    store = ClientStateStore()
    entry = save(tmp_path, store, 1, runtime({"site-a": 0}))
    (tmp_path / "checkpoints" / STORE_DIR / entry[FILES_KEY]["site-a"]).unlink()
    with pytest.raises(RuntimeError, match=r"client 'site-a': its state file .*\.clients is missing"):
        load_checkpoint(checkpoint_path(tmp_path, 1))


def test_a_checkpoint_with_inline_states_loads_unchanged(tmp_path):
    """Checkpoints written before the store hold the states themselves."""
    state = runtime({"a": 1})
    path = checkpoint_path(tmp_path, 1)
    save_checkpoint(path, {"round": 1, "runtime": state})
    assert torch.equal(load_checkpoint(path)["runtime"]["callback_states"]["a"]["Scaffold"]["c_i"], torch.ones(3))
    assert expand(state, tmp_path) is state


def test_a_runtime_entry_without_client_states_is_written_as_it_is(tmp_path):
    """A Flower server's runtime entry is only a marker (the sites keep their states): nothing is added to it."""
    marker = {"engine": "flower", "run": "r", "round": 1}
    assert save(tmp_path, ClientStateStore(), 1, marker) == marker
    assert not (tmp_path / "checkpoints" / STORE_DIR).exists()


# ------------------------------------------------------------------------------ parts bound to their checkpoint
def test_a_state_file_replaced_by_another_rounds_is_refused_and_resume_falls_back(tmp_path):
    """Round 2's state file replaced by round 1's (both valid): round 2 is unreadable, the newest intact is 1.

    Failed before: round 2's checkpoint loaded round 1's client states without a word.
    """
    store = ClientStateStore()
    first = save(tmp_path, store, 1, runtime({"a": 1, "b": 1}))
    second = save(tmp_path, store, 2, runtime({"a": 2, "b": 2}))
    directory = tmp_path / "checkpoints" / STORE_DIR
    (directory / second[FILES_KEY]["a"]).write_bytes((directory / first[FILES_KEY]["a"]).read_bytes())
    with pytest.raises(
        RuntimeError, match=r"client state file .*round-00002-.*\.clients is not the file its checkpoint"
    ):
        load_checkpoint(checkpoint_path(tmp_path, 2))
    with pytest.warns(UserWarning, match=r"skipping .*round-00002"):
        path, state = find_last_checkpoint(tmp_path)
    assert path == checkpoint_path(tmp_path, 1) and state["runtime"]["generations"] == {"a": 1, "b": 1}


def two_rounds_with_b_file(run_dir: Path, content: dict) -> None:
    """Checkpoints of rounds 1 and 2; round 2's file holding client b rewritten as ``content``, its digest matching."""
    store = ClientStateStore()
    save(run_dir, store, 1, runtime({"a": 1, "b": 1}))
    second = save(run_dir, store, 2, runtime({"a": 2, "b": 2}))
    entry = torch.load(checkpoint_path(run_dir, 2), weights_only=True)
    name = second[FILES_KEY]["b"]
    entry["runtime"][DIGESTS_KEY][name] = save_checkpoint(run_dir / "checkpoints" / STORE_DIR / name, content)
    save_checkpoint(checkpoint_path(run_dir, 2), entry)


def test_a_state_file_without_a_clients_entry_is_named_and_resume_falls_back(tmp_path):
    """Failed before: ``KeyError: 'b'`` out of ``expand`` ended the resume."""
    # a valid file that lacks client b, with the digest recorded to match (only the entry is missing)
    two_rounds_with_b_file(tmp_path, {"a": {"private": runtime({"a": 2})["private"]["a"]}})
    with pytest.raises(RuntimeError, match=r"client state file .*\.clients holds no state of client 'b'"):
        load_checkpoint(checkpoint_path(tmp_path, 2))
    with pytest.warns(UserWarning, match="holds no state of client 'b'"):
        assert find_last_checkpoint(tmp_path)[0] == checkpoint_path(tmp_path, 1)


class NotPlainData:
    """An object only a full unpickler could load."""


def test_a_garbage_checkpoint_is_called_unreadable_without_advice_to_load_it_unsafely(tmp_path):
    path = checkpoint_path(tmp_path, 1)
    path.parent.mkdir(parents=True)
    torch.save({"round": 1, "thing": NotPlainData()}, path)
    with pytest.raises(RuntimeError) as err:
        load_checkpoint(path)
    assert f"checkpoint {path} is unreadable" in str(err.value) and "weights_only" not in str(err.value)
    assert "weights_only" not in str(err.value.__cause__ or "")
    path.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(RuntimeError, match="is unreadable"):
        load_checkpoint(path)


def test_a_malformed_entry_is_refused_and_resume_falls_back(tmp_path):
    """Failed before: an entry of the wrong shape ended the resume with a TypeError in the client runtime."""
    bad = {"a": {"private": runtime({"a": 2})["private"]["a"]}, "b": {"private": {"global": [1, 2]}}}
    two_rounds_with_b_file(tmp_path, bad)
    with pytest.raises(RuntimeError, match=r"holds no valid state of client 'b'"):
        load_checkpoint(checkpoint_path(tmp_path, 2))
    with pytest.warns(UserWarning, match="holds no valid state of client 'b'"):
        assert find_last_checkpoint(tmp_path)[0] == checkpoint_path(tmp_path, 1)


def test_a_checkpoint_from_before_the_digests_says_its_files_cannot_be_checked(tmp_path):
    """Failed before: such a checkpoint accepted another round's state file without a word."""
    store = ClientStateStore()
    save(tmp_path, store, 1, runtime({"a": 1}))
    entry = torch.load(checkpoint_path(tmp_path, 1), weights_only=True)
    del entry["runtime"][DIGESTS_KEY]  # as written before client_file_digests existed
    save_checkpoint(checkpoint_path(tmp_path, 1), entry)
    with pytest.warns(UserWarning, match="written before client state files had digests: its files cannot be checked"):
        state = load_checkpoint(checkpoint_path(tmp_path, 1))
    assert state["runtime"]["generations"] == {"a": 1}
