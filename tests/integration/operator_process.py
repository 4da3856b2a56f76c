"""Run the operator as a subprocess (the `phalanx run` console script) and stop it by its PID.

Tests of faults also kill it (SIGKILL, as a node or the OOM killer would), freeze it (SIGSTOP:
its watches stall while the cluster moves on) and start it again; its log keeps every run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tests.cluster.ports import free_port
from tests.cluster.stop_on_exit import stopped_on_exit


class OperatorProcess:
    """`phalanx run --standalone` against a kubeconfig, watching one namespace (or all)."""

    def __init__(
        self,
        kubeconfig: Path,
        log: Path,
        *,
        namespace: str | Sequence[str] | None = None,
        extra_env: dict[str, str] | None = None,
        python_options: Sequence[str] = (),
    ) -> None:
        self.kubeconfig = kubeconfig
        self.python_options = list(python_options)  # before `-m phalanx`: a profiler's `-m memray run -o F`
        self.log_path = log
        # its temp dir, beside its log: a SIGKILLed run leaves its files there, not in the host's /tmp
        self.temp_dir = log.with_name(f"{log.name}.tmp")
        self.namespaces = [namespace] if isinstance(namespace, str) else list(namespace or ())
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.extra_env = extra_env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.kills = 0
        self.exited_on_its_own: list[int] = []  # exit codes of runs that ended without being stopped
        self._ended_by_us = False

    def restart(self) -> OperatorProcess:
        """Reap a stopped or killed run and start a new one, as a Deployment would."""
        if self.process is not None:
            self.process.wait(timeout=10)
        return self.start()

    def start(self) -> OperatorProcess:
        scope = [f"--namespace={name}" for name in self.namespaces] or ["--all-namespaces"]
        command = [
            sys.executable,
            *self.python_options,
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
            "TMPDIR": str(self.temp_dir),
            "PHALANX_METRICS_PORT": str(self.metrics_port),
            # the tiers install one gang scheduler's API: the other one is looked for every few
            # seconds, not every minute, so whatever that does to running jobs shows in every test
            "PHALANX_ABSENT_API_RECHECK_SECONDS": "2",
            **self.extra_env,
        }
        self.check_alive(expect=False)
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"--- phalanx run #{self.starts + 1} ---\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.starts += 1
        self._ended_by_us = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self._ended_by_us:  # killed on purpose while starting: whoever killed it restarts it
                    return self
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
        self._ended_by_us = True
        os.killpg(self.process.pid, signal.SIGCONT)  # a paused process would not see the SIGTERM
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)

    def kill(self, *, wait: bool = True) -> bool:
        """SIGKILL the operator (no clean-up of any kind runs); reap it unless ``wait`` is False
        (a callback in another thread kills, the test's thread restarts). False if it was not running."""
        if self.process is None or self.process.poll() is not None:
            return False
        self._ended_by_us = True
        os.killpg(self.process.pid, signal.SIGKILL)
        self.kills += 1
        if wait:
            self.process.wait(timeout=10)
        return True

    def pause(self) -> None:
        """SIGSTOP: the operator stops reading its watches while the cluster goes on."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGCONT)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self, *, expect: bool = True) -> None:
        """Record a run that ended without being stopped; raise if ``expect`` and it is not running."""
        if self.process is None or self.process.poll() is None:
            return
        if not self._ended_by_us:
            self._ended_by_us = True
            self.exited_on_its_own.append(int(self.process.returncode))
            if expect:
                raise RuntimeError(f"the operator exited by itself ({self.process.returncode}):\n{self.log_tail()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

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
