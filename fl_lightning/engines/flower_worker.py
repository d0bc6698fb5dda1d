"""A warm ClientApp executor for a SuperNode: one long-lived process runs every message of this project's runs.

Flower 1.42's SuperNode (``--isolation subprocess``, the default) starts a fresh ``flwr-clientapp`` process for
every message: each message then pays for importing torch and Lightning and rebuilding model, data and
Trainer (≈ 10 s on a 2-core machine), and a site's runtime lives only as long as one message. With
``flower-supernode --isolation process`` the SuperNode waits for an executor to collect its tasks; this module
is that executor. It runs each ClientApp message in this process exactly as ``flwr-clientapp`` would (pull the
message, context and FAB from the SuperNode's Runtime API, install the FAB, call the ClientApp, push the reply
and the context), except that it does not exit afterwards, so the site's runtime stays cached between messages
(:func:`fl_lightning.engines.flower_site.site_for`). The site's state is still written to its disk after every
message, so either executor gives the same results.

``python -m fl_lightning.engines.flower_worker --runtime-api-address 127.0.0.1:9094 --insecure`` (the
SuperNode's ``--host``/``--port``; on a real site pass ``--root-certificates`` when the SuperNode's Runtime API
has TLS). Built on Flower 1.42 internals (the ``flwr`` extra pins ``<1.43``).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from flwr.app import Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import ClientApp, LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

log = logging.getLogger("fl_lightning.flower_worker")


def _client(address: str, root_certificates: bytes | None, *interceptors: object) -> RuntimeHttpClient:
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=list(interceptors),
        retry_invoker=make_simple_http_retry_invoker(),
    )


def run_task(address: str, token: str, root_certificates: bytes | None = None) -> str:
    """Run one ClientApp task in this process (what ``flwr-clientapp --token`` does, without exiting)."""
    client = _client(
        address, root_certificates, RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
        RuntimeTokenHttpInterceptor(token),
    )  # fmt: skip
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = reply = context = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    try:
        message, context, run, fab = pull_task_input(client)
        install_from_fab(fab.content, skip_prompt=True)
        load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        app: ClientApp = load(run.fab_id, run.fab_version, fab.hash_str)
        reply = app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as err:  # noqa: BLE001 - the site answers with an error message, as flwr-clientapp does
        log.exception("ClientApp raised")
        code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(err, LoadClientAppError) else None
        details = f"{type(err)}:<'{err}'>"
        if message is not None:
            reply = Message(Error(code=code or ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        finally:
            push_task_output(client=client, context=context, sub_status=status, details=details)
            heartbeat.stop()
            client.close()
    return status


def serve(address: str, root_certificates: bytes | None = None, poll: float = 0.05) -> None:
    """Collect and run the SuperNode's ClientApp tasks forever."""
    client = _client(address, root_certificates, RuntimeVersionHttpInterceptor(component_name="SuperExec"))
    while True:
        res = client.AcquireTask(
            AcquireTaskRequest(supported_task_types=[str(TaskType.CLIENT_APP)], agentapp_fab_hashes=[])
        )
        if res.HasField("task") and res.token:
            run_task(address, res.token, root_certificates)
        else:
            time.sleep(poll)


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--runtime-api-address HOST:PORT`` and ``--insecure`` or ``--root-certificates PEM``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API (--host:--port)")
    parser.add_argument("--insecure", action="store_true", help="plain HTTP to the SuperNode (same machine only)")
    parser.add_argument("--root-certificates", help="CA certificate of the SuperNode's Runtime API TLS")
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between two looks for a task")
    args = parser.parse_args(argv)
    if not args.insecure and not args.root_certificates:
        parser.error("pass --root-certificates, or --insecure when the SuperNode runs on this machine")
    certs = Path(args.root_certificates).read_bytes() if args.root_certificates else None
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    import lightning  # noqa: F401 - the heavy imports once, while the SuperNode waits for its first message
    import torch  # noqa: F401

    serve(args.runtime_api_address, certs, args.poll)


if __name__ == "__main__":
    main()
