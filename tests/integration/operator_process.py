"""Run the operator as a subprocess (the `phalanx run` console script) and stop it by its PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from tests.cluster.stop_on_exit import stopped_on_exit


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OperatorProcess:
    """`phalanx run --standalone` against a kubeconfig, watching one namespace (or all)."""

    def __init__(
        self, kubeconfig: Path, log: Path, *, namespace: str | None = None, extra_env: dict[str, str] | None = None
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log
        self.namespace = namespace
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.extra_env = extra_env or {}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        scope = [f"--namespace={self.namespace}"] if self.namespace else ["--all-namespaces"]
        command = [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--standalone",
            *scope,
            f"--liveness=http://127.0.0.1:{self.health_port}/healthz",
        ]
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PHALANX_METRICS_PORT": str(self.metrics_port),
            **self.extra_env,
        }
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"operator exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2):
                    return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"operator not healthy within 60s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the operator's process group, SIGKILL it if it does not stop."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> OperatorProcess:
        self._stop_guard = stopped_on_exit(self.stop)
        self._stop_guard.__enter__()  # also stopped if pytest is killed
        try:
            return self.start()
        except BaseException:
            self._stop_guard.__exit__(None, None, None)
            raise

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop_guard.__exit__(kind, error, trace)
