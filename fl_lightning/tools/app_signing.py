r"""Sign a Flower App Bundle (FAB) so that SuperNodes started with ``--trusted-entities`` run it, and nothing else.

A SuperNode given ``--trusted-entities trusted.yaml`` (``{key id: "ssh-ed25519 AAAA…"}``) refuses every app
whose FAB carries no Ed25519 signature by one of those keys over ``signed_at`` (8 bytes, big-endian) followed by
SHA-256(FAB), the message of ``flwr app review``. This module makes that signature with Flower's own primitives
(:mod:`flwr.supercore.primitives.asymmetric_ed25519`, as ``flwr app review`` does), for consortia that review and
sign their release themselves instead of on Flower Hub; :mod:`fl_lightning.tools.app_registry` then hands the FAB
and its signatures to the SuperLink.

Usage::

    flwr build --app .                                         # → fl-lightning.fl-lightning.0-1-0.<hash>.fab
    python -m fl_lightning.tools.app_signing sign fl-lightning.fl-lightning.0-1-0.*.fab \
        --key ~/.ssh/fl_review --key-id hospital-a-it
    python -m fl_lightning.tools.app_signing check fl-lightning.fl-lightning.0-1-0.*.fab --trusted trusted.yaml

``sign`` appends the signature to ``<fab>.signatures.json`` (several reviewers may sign one FAB; a SuperNode
runs it if any key it trusts signed it); ``check`` says which of them a ``trusted.yaml`` accepts, as a SuperNode
would decide.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

SIGNATURES_SUFFIX = ".signatures.json"


def signatures_path(fab: Path) -> Path:
    """Where the signatures of ``fab`` are kept: beside it, ``<fab>.signatures.json``."""
    return fab.with_name(fab.name + SIGNATURES_SUFFIX)


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(fab: bytes, private_key: Path, key_id: str, signed_at: int | None = None) -> dict[str, Any]:
    """A signature record of ``fab`` by the OpenSSH Ed25519 key at ``private_key``, as Flower Hub hands it out.

    Returns:
        ``{"public_key_id": key_id, "signature": base64url, "signed_at": seconds}``.

    Raises:
        ValueError: If the key is not an unencrypted OpenSSH Ed25519 private key (``ssh-keygen -t ed25519``).
    """
    from flwr.supercore.primitives.asymmetric_ed25519 import create_message_to_sign, load_private_key, sign_message

    if not key_id or any(c.isspace() for c in key_id):
        raise ValueError(f"--key-id names the key in every SuperNode's trusted.yaml: one word, got {key_id!r}")
    try:
        key = load_private_key(private_key)
    except (ValueError, TypeError) as err:  # cryptography's errors for another format, a passphrase, another type
        raise ValueError(
            f"{private_key}: not an unencrypted OpenSSH Ed25519 private key ({err}); make one with "
            "`ssh-keygen -t ed25519 -N '' -f KEY`"
        ) from None
    when = int(time.time()) if signed_at is None else int(signed_at)
    message = create_message_to_sign(hashlib.sha256(fab).digest(), when)
    return {"public_key_id": key_id, "signature": _b64url(sign_message(key, message)), "signed_at": when}


def read_trusted(path: Path) -> dict[str, str]:
    """A SuperNode's ``--trusted-entities`` file: ``{key id: "ssh-ed25519 AAAA…"}``.

    Raises:
        ValueError: Naming the file and the entry that is not an OpenSSH Ed25519 public key.
    """
    import yaml
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key

    trusted = yaml.safe_load(path.read_text())
    if not isinstance(trusted, dict) or not trusted:
        raise ValueError(f"{path}: expected a mapping of key ids to 'ssh-ed25519 …' public keys")
    for key_id, public in trusted.items():
        try:
            ok = isinstance(load_ssh_public_key(str(public).encode()), ed25519.Ed25519PublicKey)
        except (ValueError, TypeError):
            ok = False
        if not ok:
            raise ValueError(f"{path}: entry {key_id!r} is not an OpenSSH Ed25519 public key (the .pub line)")
    return {str(k): str(v) for k, v in trusted.items()}


def accepted_by(fab: bytes, signatures: list[dict[str, Any]], trusted: dict[str, str]) -> list[str]:
    """The key ids of ``trusted`` whose signature of ``fab`` is valid: what a SuperNode with them would accept."""
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key
    from flwr.supercore.primitives.asymmetric_ed25519 import create_message_to_sign, verify_signature

    digest = hashlib.sha256(fab).digest()
    ok = []
    for record in signatures:
        key_id = record.get("public_key_id")
        if key_id not in trusted:
            continue
        public = load_ssh_public_key(trusted[key_id].encode())
        message = create_message_to_sign(digest, int(record["signed_at"]))
        if verify_signature(public, message, _unb64url(str(record["signature"]))):  # type: ignore[arg-type]
            ok.append(key_id)
    return ok


def read_signatures(fab: Path) -> list[dict[str, Any]]:
    """The signature records kept beside ``fab`` (none if there is no file).

    Raises:
        ValueError: If the file is not a list of signature records (naming it).
    """
    path = signatures_path(fab)
    if not path.exists():
        return []
    records = json.loads(path.read_text())
    keys = {"public_key_id", "signature", "signed_at"}
    if not isinstance(records, list) or not all(isinstance(r, dict) and set(r) == keys for r in records):
        raise ValueError(f"{path}: expected a list of {sorted(keys)} records (written by `app_signing sign`)")
    return records


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m fl_lightning.tools.app_signing``."""
    summary = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m fl_lightning.tools.app_signing", description=summary)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sign", help="sign a FAB with an OpenSSH Ed25519 key (ssh-keygen -t ed25519)")
    s.add_argument("fab", type=Path)
    s.add_argument("--key", type=Path, required=True, help="the private key file")
    s.add_argument("--key-id", required=True, help="the key's name in the SuperNodes' trusted.yaml")
    c = sub.add_parser("check", help="which keys of a trusted.yaml accept the FAB's signatures")
    c.add_argument("fab", type=Path)
    c.add_argument("--trusted", type=Path, required=True, help="a SuperNode's --trusted-entities file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``sign`` a FAB (append its signature record) or ``check`` it against a ``trusted.yaml``."""
    args = build_parser().parse_args(argv)
    try:
        fab = args.fab.read_bytes()
        records = read_signatures(args.fab)
        if args.command == "sign":
            record = sign(fab, args.key, args.key_id)
            records = [r for r in records if r["public_key_id"] != args.key_id] + [record]
            signatures_path(args.fab).write_text(json.dumps(records, indent=2) + "\n")
            print(f"signed {args.fab.name} as {args.key_id!r} (sha256 {hashlib.sha256(fab).hexdigest()[:16]}…)")
            return 0
        ok = accepted_by(fab, records, read_trusted(args.trusted))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"accepted by {ok}" if ok else f"{args.fab.name}: no signature by a key of {args.trusted} (refused)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
