"""A consortium's own app registry: hands the SuperLink a reviewed FAB and its signatures, as Flower Hub does.

A Flower 1.42 SuperLink takes an app's signatures only from a Hub: ``flwr run @publisher/name==version`` makes it
ask ``$FLWR_SUPERGRID_API_URL/hub/fetch-fab`` for a download URL and the signature records, fetch the FAB and pass
both to the SuperNodes, which run it only if a key of their ``--trusted-entities`` signed it. Where the signed
release lives on Flower Hub (``flwr app publish``, ``flwr app review``) no registry is needed; a consortium that
reviews and signs its releases itself (:mod:`fl_lightning.tools.app_signing`) serves them with this one and starts
its SuperLink with ``FLWR_SUPERGRID_API_URL=http://<registry>/v1``.

The registry needs no trust: a SuperNode checks every signature itself, so a registry (or a SuperLink) that serves
another FAB, or strips or forges signatures, gets that FAB refused. It serves the ``*.fab`` files of one folder,
each found by its own ``pyproject.toml`` (``[tool.flwr.app] publisher``, ``[project] name`` and ``version``), with
the records of ``<fab>.signatures.json`` beside it.

Usage::

    python -m fl_lightning.tools.app_registry signed/ --host 127.0.0.1 --port 8765
"""

from __future__ import annotations

import argparse
import json
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fl_lightning.tools.app_signing import read_signatures

FETCH = "/v1/hub/fetch-fab"
MAX_REQUEST_BYTES = 4096  # a fetch request is an app id and a version


def app_spec(fab: bytes) -> tuple[str, str]:
    """``("@publisher/name", version)`` of a FAB, read from the ``pyproject.toml`` inside it.

    Raises:
        ValueError: If it is not a FAB (a zip holding a pyproject.toml with those entries).
    """
    from flwr.common.config import get_fab_config  # Flower's own reading of a FAB (zip, pyproject.toml, keys)

    try:
        meta = get_fab_config(fab)
    except (ValueError, KeyError, zipfile.BadZipFile) as err:  # not a zip, no pyproject.toml, a wrong one
        raise ValueError(f"not a Flower App Bundle: {err}") from None
    return f"@{meta['tool']['flwr']['app']['publisher']}/{meta['project']['name']}", str(meta["project"]["version"])


def index(folder: Path) -> dict[tuple[str, str], Path]:
    """Every FAB of ``folder`` by its ``(app id, version)``.

    Raises:
        ValueError: If a file is not a FAB, or two FABs claim one app version (naming them).
    """
    found: dict[tuple[str, str], Path] = {}
    for path in sorted(folder.glob("*.fab")):
        try:
            spec = app_spec(path.read_bytes())
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        if spec in found:
            raise ValueError(f"{found[spec].name} and {path.name} are both {spec[0]}=={spec[1]}: keep one")
        read_signatures(path)  # a broken signature file is an error at start, not a refusal at every site
        found[spec] = path
    return found


def serve(folder: Path, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A registry of ``folder``'s FABs on ``host:port`` (0: a free port), serving in a daemon thread.

    Call ``shutdown()`` on the returned server to stop it; ``server_address`` says where it listens.
    """
    fabs = index(folder)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
            pass  # the SuperLink logs what it fetched

        def _json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("Content-Length") or 0)
            if self.path != FETCH or not 0 < length <= MAX_REQUEST_BYTES:
                self._json(404, {"detail": f"only POST {FETCH} with a small JSON body is served"})
                return
            try:
                body = json.loads(self.rfile.read(length))
                spec = (str(body["app_id"]), str(body["app_version"]))
            except (ValueError, KeyError, TypeError):
                self._json(400, {"detail": "expected {app_id, app_version}"})
                return
            if spec not in fabs:
                versions = [v for a, v in fabs if a == spec[0]]
                self._json(404, {"detail": {"available_app_versions": versions}})
                return
            path = fabs[spec]
            host_, port_ = self.server.server_address[:2]
            self._json(
                200,
                {"fab_url": f"http://{host_}:{port_}/fab/{path.name}", "verifications": read_signatures(path)},
            )

        def do_GET(self) -> None:  # noqa: N802
            names = {p.name: p for p in fabs.values()}
            name = self.path.removeprefix("/fab/")
            if not self.path.startswith("/fab/") or name not in names:
                self._json(404, {"detail": "no such FAB"})
                return
            data = names[name].read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="fl-app-registry", daemon=True).start()
    return server


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m fl_lightning.tools.app_registry``."""
    summary = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m fl_lightning.tools.app_registry", description=summary)
    parser.add_argument("folder", type=Path, help="the folder of *.fab files and their .signatures.json")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Serve a folder of signed FABs until interrupted."""
    args = build_parser().parse_args(argv)
    try:
        server = serve(args.folder, args.host, args.port)
    except (OSError, ValueError) as err:
        print(f"error: {err}")
        return 2
    host, port = server.server_address[:2]
    for (app, version), path in index(args.folder).items():
        print(f"{app}=={version}: {path.name}, {len(read_signatures(path))} signature(s)")
    print(f"serving on http://{host}:{port}; start the SuperLink with FLWR_SUPERGRID_API_URL=http://{host}:{port}/v1")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
