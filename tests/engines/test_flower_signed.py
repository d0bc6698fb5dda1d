"""Approved code only: SuperNodes started with ``--trusted-entities`` run a FAB signed by a key they trust, and
refuse an unsigned or tampered one (the run then ends with a message naming the sites)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the `flower` extra: pip install -e '.[flower]'")

import requests  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: E402
from flwr.cli.build import build_fab_from_disk  # noqa: E402

from fl_lightning.tools import app_registry, app_signing  # noqa: E402
from tests.engines.deployment import ROOT, Deployment  # noqa: E402
from tests.engines.test_flower import TINY, assert_same_weights, final_state, inprocess  # noqa: E402

APP = "@fl-lightning/fl-lightning==0.1.0"


def ssh_key_pair(folder: Path, name: str) -> tuple[Path, str]:
    """An unencrypted OpenSSH Ed25519 key file (what ``ssh-keygen -t ed25519 -N ''`` writes) and its .pub line."""
    key = ed25519.Ed25519PrivateKey.generate()
    path = folder / name
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return path, public.decode()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The project's FAB signed by a reviewer's key; a trusted.yaml with it; a tampered FAB with its signature."""
    root = tmp_path_factory.mktemp("release")
    key, public = ssh_key_pair(root, "reviewer")
    signed = root / "signed"
    signed.mkdir()
    fab = signed / "fl-lightning.fl-lightning.0-1-0.fab"
    fab.write_bytes(build_fab_from_disk(ROOT))
    assert app_signing.main(["sign", str(fab), "--key", str(key), "--key-id", "hospital-it"]) == 0
    trusted = root / "trusted.yaml"
    trusted.write_text(f'hospital-it: "{public}"\n')
    # Other code under the same name and the same signature: what a compromised SuperLink or registry could push.
    other = root / "other-app"
    shutil.copytree(ROOT, other, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "site", "__pycache__"))
    with (other / "fl_lightning" / "engines" / "flower.py").open("a") as f:
        f.write("\nEXFILTRATE = True  # not the reviewed code\n")
    tampered = root / "tampered"
    tampered.mkdir()
    (tampered / fab.name).write_bytes(build_fab_from_disk(other))
    shutil.copy(app_signing.signatures_path(fab), app_signing.signatures_path(tampered / fab.name))
    return {"signed": signed, "tampered": tampered, "fab": fab, "trusted": trusted, "key": key}


# ------------------------------------------------------------------------------------------------ no processes
def test_a_signature_verifies_only_its_fab_and_only_for_a_trusted_key(release, tmp_path):
    fab, records = release["fab"].read_bytes(), app_signing.read_signatures(release["fab"])
    trusted = app_signing.read_trusted(release["trusted"])
    assert app_signing.accepted_by(fab, records, trusted) == ["hospital-it"]
    assert app_signing.accepted_by(fab + b"\0", records, trusted) == []  # another FAB
    assert app_signing.accepted_by(fab, [{**records[0], "signed_at": 1}], trusted) == []  # another time
    _, stranger = ssh_key_pair(tmp_path, "stranger")
    assert app_signing.accepted_by(fab, records, {"hospital-it": stranger}) == []  # another key under that name
    assert app_signing.main(["check", str(release["fab"]), "--trusted", str(release["trusted"])]) == 0
    tampered = release["tampered"] / release["fab"].name
    assert app_signing.main(["check", str(tampered), "--trusted", str(release["trusted"])]) == 1


def test_signing_refuses_what_flower_could_not_verify(tmp_path, capsys):
    fab = tmp_path / "app.fab"
    fab.write_bytes(b"not signed yet")
    rsa = tmp_path / "id_rsa"
    rsa.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nbm90IGEga2V5\n-----END OPENSSH PRIVATE KEY-----\n")
    assert app_signing.main(["sign", str(fab), "--key", str(rsa), "--key-id", "it"]) == 2
    assert "not an unencrypted OpenSSH Ed25519 private key" in capsys.readouterr().err
    key, _ = ssh_key_pair(tmp_path, "k")
    assert app_signing.main(["sign", str(fab), "--key", str(key), "--key-id", "two words"]) == 2
    bad = tmp_path / "trusted.yaml"
    bad.write_text("it: ssh-rsa AAAAB3NzaC1yc2E\n")
    with pytest.raises(ValueError, match="entry 'it' is not an OpenSSH Ed25519 public key"):
        app_signing.read_trusted(bad)
    # a second reviewer's signature is added beside the first; signing again with one key replaces its own
    assert app_signing.main(["sign", str(fab), "--key", str(key), "--key-id", "a"]) == 0
    assert app_signing.main(["sign", str(fab), "--key", str(key), "--key-id", "b"]) == 0
    assert app_signing.main(["sign", str(fab), "--key", str(key), "--key-id", "a"]) == 0
    assert [r["public_key_id"] for r in app_signing.read_signatures(fab)] == ["b", "a"]


def test_the_registry_answers_as_flower_hub_does(release):
    from flwr.supercore.utils import request_download_link  # what the SuperLink calls

    server = app_registry.serve(release["signed"])
    try:
        host, port = server.server_address[:2]
        url = f"http://{host}:{port}/v1/hub/fetch-fab"
        fab_url, verifications, _note = request_download_link("@fl-lightning/fl-lightning", "0.1.0", url, "fab_url")
        assert verifications == app_signing.read_signatures(release["fab"])
        assert requests.get(fab_url, timeout=10).content == release["fab"].read_bytes()
        with pytest.raises(ValueError, match=r"0.2.0 not found .*Available app versions .*: 0.1.0"):
            request_download_link("@fl-lightning/fl-lightning", "0.2.0", url, "fab_url")
        assert requests.post(url, data=b"x" * 5000, timeout=10).status_code == 404  # no large bodies read
        assert requests.get(f"http://{host}:{port}/fab/../pyproject.toml", timeout=10).status_code == 404
    finally:
        server.shutdown()


def test_the_registry_refuses_a_folder_it_could_serve_wrongly(tmp_path, release):
    (tmp_path / "a.fab").write_bytes(release["fab"].read_bytes())
    (tmp_path / "b.fab").write_bytes(release["fab"].read_bytes())
    with pytest.raises(ValueError, match="a.fab and b.fab are both @fl-lightning/fl-lightning==0.1.0"):
        app_registry.index(tmp_path)
    (tmp_path / "b.fab").write_bytes(b"PK not a zip")
    with pytest.raises(ValueError, match="b.fab: not a Flower App Bundle"):
        app_registry.index(tmp_path)


# ------------------------------------------------------------------------------------------------ deployment
def deploy_trusting(d: Deployment, release, registry: Path) -> None:
    server = app_registry.serve(registry)
    d.cleanup = server.shutdown  # type: ignore[attr-defined]
    host, port = server.server_address[:2]
    d.start_superlink(registry=f"http://{host}:{port}/v1")
    for i in range(2):
        d.start_supernode(
            f"node{i}", f'fl-clients="site{i}" fl-state-dir="{d.workdir}/site{i}"', trusted=release["trusted"]
        )


def run_config(d: Deployment, extra: list[str]) -> str:
    overrides = " ".join([*extra, f"--federation.output_dir={d.workdir}/runs", "--federation.run_name=flower"])
    return f'config="configs/fedavg_digits.yaml" overrides="{overrides}" min-nodes=2 poll=0.02'


@pytest.mark.slow  # its error path is covered by test_flower_wire.py's refusal test
@pytest.mark.parametrize("app", ["unsigned", "tampered"])
def test_supernodes_refuse_an_unsigned_or_tampered_app_and_the_run_names_them(tmp_path, release, app):
    d = Deployment(tmp_path)
    try:
        deploy_trusting(d, release, release["tampered"] if app == "tampered" else release["signed"])
        with pytest.raises(RuntimeError, match="the ServerApp did not finish") as err:
            # unsigned: the project folder itself; tampered: other code served under the signed release's name
            d.flwr_run(run_config(d, TINY), tmp_path / "runs" / "flower" / "summary.json", timeout=180,
                       app=None if app == "unsigned" else APP)  # fmt: skip
        log = str(err.value)
        for node in ("node0", "node1"):
            assert "FAB verification failed" in (tmp_path / f"{node}.log").read_text() or app == "unsigned"
        assert log.count("it refused to run this app: no key of its --trusted-entities signed this FAB") >= 2, log
        assert "no SuperNode described any client" in log
        assert not (tmp_path / "site0").exists()  # no site read its data or wrote a state: nothing of ours ran
    finally:
        getattr(d, "cleanup", lambda: None)()
        d.stop()


@pytest.mark.slow
def test_the_signed_app_runs_on_trusting_supernodes_and_gives_the_inprocess_weights(tmp_path, release):
    d = Deployment(tmp_path)
    try:
        deploy_trusting(d, release, release["signed"])
        run_dir = tmp_path / "runs" / "flower"
        d.flwr_run(run_config(d, TINY), run_dir / "summary.json", app=APP)
        assert_same_weights(final_state(run_dir), final_state(inprocess(tmp_path, "configs/fedavg_digits.yaml", TINY)))
        assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2
    finally:
        getattr(d, "cleanup", lambda: None)()
        d.stop()
