"""Operator replicas of the chaos tier: each one a `phalanx run` process behind a fault proxy of
its own, so that what each sent is known by sender (``tests/chaos/audit.py``).

    replica = Replica("a", proxy, identity, OperatorProcess(...))
    with replica:                    # started; stopped by its PID at the end
        replica.run_of(request)      # "a#2": which of its processes sent a request its proxy got
        replica.memory()             # (VmRSS, VmHWM) in MiB of the live process, None if none
        replica.restart()            # after a kill or an exit, as a Deployment would
"""

from __future__ import annotations

import pathlib
from types import TracebackType

from tests.cluster.faultproxy import FaultProxy, Request
from tests.integration.operator_process import OperatorProcess


class Replica:
    """See the module docstring."""

    def __init__(self, name: str, proxy: FaultProxy, identity: pathlib.Path, process: OperatorProcess) -> None:
        self.name = name
        self.proxy = proxy
        self.identity = identity  # the kubeconfig (a token user) each run's is made from
        self.process = process
        self._runs: dict[int, str] = {}  # the proxy's port each run talks to -> "a#2"

    def _begin(self) -> None:
        # Each run gets a port of the proxy for itself, in the kubeconfig it starts with: a request
        # is known by the port it came by, also when it reached the proxy after its sender died
        # (time, on a busy host, would name the next run).
        url = self.proxy.listen()
        self.proxy.kubeconfig(self.identity, self.process.kubeconfig, url)
        self._runs[int(url.rsplit(":", 1)[1])] = f"{self.name}#{len(self._runs) + 1}"

    def run_of(self, request: Request) -> str:
        """Which run sent ``request`` (by the proxy's port it came by)."""
        return self._runs[request.port]

    @property
    def current(self) -> str:
        return f"{self.name}#{len(self._runs)}"

    def restart(self) -> None:
        if self.process.process is not None:
            self.process.process.wait(timeout=10)
        self._begin()
        self.process.start()

    def memory(self) -> tuple[float, float] | None:
        """Resident set now and at its peak (VmRSS, VmHWM), in MiB; None when no process runs."""
        popen = self.process.process
        if popen is None or popen.poll() is not None:
            return None
        try:
            text = pathlib.Path(f"/proc/{popen.pid}/status").read_text()
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        try:
            rss, hwm = (int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM"))
        except (KeyError, ValueError):
            return None
        return rss, hwm

    def __enter__(self) -> Replica:
        self._begin()
        self.process.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.process.__exit__(kind, error, trace)
