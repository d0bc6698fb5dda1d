"""A real Flower deployment on loopback for the tests: one SuperLink and SuperNodes, each a process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fl_lightning.engines.local_ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def wait_port(port: int, timeout: float = 60.0) -> None:
    """Block until something listens on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Deployment:
    """SuperLink + SuperNodes on 127.0.0.1 (insecure: loopback only), every process stopped by its group id."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.flwr_home = workdir / "flwr_home"
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(self.flwr_home),
            "OMP_NUM_THREADS": "1",
            "WANDB_SILENT": "true",
            "WANDB_MODE": "offline",
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = 0

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            cmd, cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs[name] = proc
        return proc

    def start_superlink(self, registry: str | None = None) -> None:
        """The SuperLink; ``registry``: the app registry (Flower Hub's API) it fetches ``@publisher/name`` apps from."""
        self.port = free_port()
        if registry is not None:
            self.env["FLWR_SUPERGRID_API_URL"] = registry
        self._spawn(
            "superlink",
            [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
             "--disable-runtime-dependency-installation"],
        )  # fmt: skip
        wait_port(self.port)
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n'
            "insecure = true\n"
        )

    def start_supernode(self, name: str, node_config: str, warm: bool = True, trusted: Path | None = None) -> None:
        """A SuperNode; ``warm``: with our long-lived ClientApp executor (else one flwr-clientapp per message);
        ``trusted``: its ``--trusted-entities`` file (it then runs only apps signed by one of those keys)."""
        runtime_port = free_port()
        self._spawn(
            name,
            [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
             "--host", "127.0.0.1", "--port", str(runtime_port), "--node-config", node_config,
             *(["--isolation", "process"] if warm else []),
             *(["--trusted-entities", str(trusted)] if trusted is not None else [])],
        )  # fmt: skip
        if warm:
            wait_port(runtime_port)
            self._spawn(
                f"{name}-worker",
                [sys.executable, "-m", "fl_lightning.engines.flower_worker", "--runtime-api-address",
                 f"127.0.0.1:{runtime_port}", "--insecure"],
            )  # fmt: skip

    def kill_node(self, name: str) -> None:
        """Kill a SuperNode and its executor (SIGKILL: no goodbye to the SuperLink)."""
        self.kill(f"{name}-worker")
        self.kill(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)  # the process group: the SuperNode and the ClientApp processes it started
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)

    def flwr_run(self, run_config: str, done: Path, timeout: float = 600, app: str | None = None) -> int:
        """Submit the project (or ``app``: ``@publisher/name==version`` from the registry) with ``flwr run`` and wait
        until ``done`` exists (the ServerApp's summary.json). Returns the run id.

        Raises:
            RuntimeError: If the submission or the ServerApp failed (with the run's log and the processes' logs).
        """
        cmd = [str(BIN / "flwr"), "run", app or str(ROOT), "loopback", "--run-config", run_config, "--format", "json"]
        failures = self.server_failures()
        sub = subprocess.run(
            cmd, cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=120, check=False
        )
        if sub.returncode != 0:
            raise RuntimeError(f"flwr run failed:\n{sub.stdout}\n{sub.stderr}\n{self.logs()}")
        run_id = int(json.loads(sub.stdout)["run-id"])
        deadline, looked = time.monotonic() + timeout, time.monotonic()
        while not done.exists():
            failed = self.server_failures() > failures or time.monotonic() > deadline
            if not failed and time.monotonic() - looked > 3:  # a CLI call costs a second: not every poll
                looked = time.monotonic()
                failed = self.run_status(run_id).startswith("finished") and not done.exists()
            if failed:
                raise RuntimeError(f"the ServerApp did not finish:\n{self.run_log(run_id)}\n{self.logs()}")
            time.sleep(0.2)
        return run_id

    def _flwr(self, *args: str) -> str:
        sub = subprocess.run(
            [str(BIN / "flwr"), *args], cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=60
        )
        return sub.stdout

    def run_status(self, run_id: int) -> str:
        """The run's status as the SuperLink reports it (``running``, ``finished:failed`` …)."""
        try:
            (row,) = json.loads(self._flwr("ls", "loopback", "--run-id", str(run_id), "--format", "json"))["runs"]
        except (ValueError, KeyError):
            return "unknown"
        return str(row["status"])

    def run_log(self, run_id: int) -> str:
        """What the run's ServerApp printed (its traceback included), as ``flwr log`` shows it."""
        return self._flwr("log", str(run_id), "loopback", "--show")

    def server_failures(self) -> int:
        """How many ServerApps of this SuperLink raised (each failed run adds one line to its log)."""
        return (self.workdir / "superlink.log").read_text(errors="replace").count("ServerApp raised an exception")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.workdir.glob("*.log"))

    def stop(self) -> None:
        for name in list(self.procs)[::-1]:
            self.kill(name, signal.SIGTERM)
