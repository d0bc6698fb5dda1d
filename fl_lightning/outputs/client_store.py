"""Clients' runtime states beside the round checkpoints: each save writes only the clients that changed.

A save writes the clients whose state changed since the last save (the runtime counts the tasks each client
answered: ``generations``) into one new file,
``checkpoints/clients/round-NNNNN-<token>.clients``, and the checkpoint names, for every client, the file that
holds its newest state. Files are never rewritten (a name is used once), so an older checkpoint stays valid; a file
no kept checkpoint names is deleted after the save. A file whose live clients fall below half of those it holds has
them copied into the new file, so the disk use stays within about twice one full copy.

:func:`expand` puts the states back into a loaded checkpoint, so readers see the full state; a checkpoint
without ``client_files`` holds its states inline and loads unchanged.
The checkpoint also records each file's sha256 (``client_file_digests``), so a file replaced by another valid
one (another round's) is refused as not the checkpoint's, like a damaged one, and the resume falls back to the
previous checkpoint; a checkpoint without ``client_file_digests`` (written before they existed) loads without
that check, with a warning saying so. An entry whose shape the runtime could not restore is refused the same way.
"""

from __future__ import annotations

import secrets
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from datamodules.files import load_state_file

# The runtime state's per-client entries kept out of the checkpoint (the rest is small: sampler epochs).
# Why: they can hold a model's worth per client (SCAFFOLD's c_i), and only the clients that took part change.
CLIENT_KEYS = ("private", "optimizer_states", "callback_states", "personal")
FILES_KEY = "client_files"  # client -> file name in STORE_DIR, in a checkpoint's "runtime" entry
DIGESTS_KEY = "client_file_digests"  # file name -> the sha256 it was written with, beside FILES_KEY
STORE_DIR = "clients"
SUFFIX = ".clients"


def split(runtime: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each client's entries of ``CLIENT_KEYS`` (``{client: {key: state}}``)."""
    out: dict[str, dict[str, Any]] = {}
    for key in CLIENT_KEYS:
        for cid, state in runtime.get(key, {}).items():
            out.setdefault(cid, {})[key] = state
    return out


def expand(runtime: dict[str, Any], directory: Path) -> dict[str, Any]:
    """A checkpoint's runtime entry with its clients' states read back from ``directory`` (the checkpoints').

    Raises:
        RuntimeError: If a file the checkpoint names is missing, unreadable, not the file the checkpoint was
            written with (its recorded digest differs) or lacks the client's entry, naming the file and the client.
    """
    files: dict[str, str] = runtime.get(FILES_KEY) or {}
    if not files:
        return runtime
    digests: dict[str, str] = runtime.get(DIGESTS_KEY) or {}
    if DIGESTS_KEY not in runtime:
        warnings.warn(
            f"the checkpoint in {directory} was written before client state files had digests: its files cannot be "
            "checked against it (a file replaced by another round's would go unnoticed); checkpoints written from "
            "now on record them",
            UserWarning,
            stacklevel=2,
        )
    full = {k: v for k, v in runtime.items() if k not in (FILES_KEY, DIGESTS_KEY)}
    for key in CLIENT_KEYS:
        full[key] = dict(full.get(key, {}))
    loaded: dict[str, dict[str, Any]] = {}
    for cid, name in files.items():
        path = directory / STORE_DIR / name
        if name not in loaded:
            if not path.is_file():
                raise RuntimeError(f"client {cid!r}: its state file {path} is missing")
            loaded[name] = load_state_file(path, "client state file", sha256=digests.get(name))
        entry = loaded[name].get(cid)
        if not _valid_entry(entry):
            what = "no state" if entry is None else "no valid state"
            raise RuntimeError(f"client state file {path} holds {what} of client {cid!r}, which its checkpoint names")
        for key, state in entry.items():
            full[key][cid] = state
    return full


def _valid_entry(entry: Any) -> bool:
    """Whether a file's entry for one client has the shape the runtime restores (else the resume would crash).

    ``{key: {name: state}}`` for keys of :data:`CLIENT_KEYS`, private and personal states as
    ``{group: {name: tensor}}``.
    """
    if not isinstance(entry, dict) or not set(entry) <= set(CLIENT_KEYS):
        return False
    if not all(isinstance(v, dict) and all(isinstance(k, str) for k in v) for v in entry.values()):
        return False
    models = [*entry.get("private", {}).values(), *entry.get("personal", {}).values()]
    return all(isinstance(group, dict) and all(isinstance(t, torch.Tensor) for t in group.values()) for group in models)


def referenced_files(runtime: dict[str, Any]) -> set[str]:
    """The client state files a checkpoint's (unexpanded) runtime entry names."""
    return set((runtime.get(FILES_KEY) or {}).values())


class ClientStateStore:
    """Writes the clients' states of successive checkpoints of one run, each client only when it changed.

    The files go beside the checkpoints (``<checkpoint dir>/clients/``), named after the checkpoint that first
    names them.
    """

    def __init__(self) -> None:
        self.directory: Path | None = None  # <checkpoint dir>/clients, from the first checkpoint written
        self.location: dict[str, str] = {}  # client -> file holding its newest written state
        self.generation: dict[str, int] = {}  # client -> the runtime's task count when it was written
        self.held: dict[str, int] = {}  # file -> clients written into it
        self.digest: dict[str, str] = {}  # file -> its sha256
        self.references: dict[str, set[str]] = {}  # checkpoint file name -> the state files it names

    def write(self, runtime: dict[str, Any], checkpoint: Path, save: Callable[[Path, Any], str]) -> dict[str, Any]:
        """Write the changed clients' states; returns the checkpoint's runtime entry (client states as file names).

        Args:
            runtime: The runtime state (:meth:`fl_lightning.runtime.ClientRuntime.state_dict`).
            checkpoint: The checkpoint about to be written (its directory and name place and name the file).
            save: ``save(path, obj)``, an atomic, durable write that returns the file's sha256
                (:func:`fl_lightning.outputs.checkpoint.save_checkpoint`).

        """
        self.directory = checkpoint.parent / STORE_DIR
        if not any(key in runtime for key in CLIENT_KEYS):  # a deployment's sites keep their states themselves
            return runtime
        clients = split(runtime)
        generations = runtime.get("generations", {})
        self.location = {c: f for c, f in self.location.items() if c in clients}  # a client whose state is gone
        changed = {c for c in clients if c not in self.location or self.generation[c] != generations.get(c, 0)}
        live = Counter(f for c, f in self.location.items() if c not in changed)
        sparse = {f for f, n in live.items() if 2 * n < self.held[f]}  # mostly superseded: copy its live clients on
        changed |= {c for c, f in self.location.items() if f in sparse}
        if changed:
            name = f"{checkpoint.stem}-{secrets.token_hex(4)}{SUFFIX}"
            self.digest[name] = save(self.directory / name, {c: clients[c] for c in sorted(changed)})
            self.held[name] = len(changed)
            for c in changed:
                self.location[c], self.generation[c] = name, generations.get(c, 0)
        named = set(self.location.values())
        digests = {f: d for f, d in self.digest.items() if f in named}
        return {**runtime, **{k: {} for k in CLIENT_KEYS}, FILES_KEY: dict(self.location), DIGESTS_KEY: digests}

    def remember(self, checkpoint: Path, runtime_entry: dict[str, Any]) -> None:
        """Note the files a checkpoint just written names (so pruning need not read it back)."""
        self.references[checkpoint.name] = referenced_files(runtime_entry)

    def prune(self, checkpoints: list[Path]) -> list[Path]:
        """Delete the state files that none of ``checkpoints`` (the kept ones) names.

        A kept checkpoint this store did not write (one from before a resume) is read once for its file names; one
        that cannot be read names none (it cannot be resumed either).

        Returns:
            The files deleted.
        """
        for path in checkpoints:
            if path.name not in self.references:
                try:
                    self.remember(path, load_state_file(path, "checkpoint").get("runtime", {}))
                except RuntimeError:
                    self.references[path.name] = set()
        self.references = {p.name: self.references[p.name] for p in checkpoints}  # pruned ones name nothing
        keep = set(self.location.values()).union(*self.references.values())
        removed = []
        if self.directory is not None and self.directory.is_dir():
            for path in self.directory.iterdir():
                if path.suffix == SUFFIX and path.name not in keep:
                    path.unlink(missing_ok=True)
                    self.held.pop(path.name, None)
                    self.digest.pop(path.name, None)
                    removed.append(path)
        return removed
