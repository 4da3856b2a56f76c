"""Operator replicas of the chaos tier: each one a `phalanx run` process behind a fault proxy of
its own, so that what each sent is known by sender (``tests/chaos/audit.py``).

    replica = Replica("a", proxy, OperatorProcess(...))
    with replica:                    # started; stopped by its PID at the end
        replica.run_at(t)            # "a#2": which of its processes ran at monotonic time t (a
                                     # request's connection_since: when its connection was first used)
        replica.memory()             # (VmRSS, VmHWM) in MiB of the live process, None if none
        replica.restart()            # after a kill or an exit, as a Deployment would
"""

from __future__ import annotations

import bisect
import pathlib
import time
from types import TracebackType

from tests.cluster.faultproxy import FaultProxy
from tests.integration.operator_process import OperatorProcess


class Replica:
    """See the module docstring."""

    def __init__(self, name: str, proxy: FaultProxy, process: OperatorProcess) -> None:
        self.name = name
        self.proxy = proxy
        self.process = process
        self._starts: list[float] = []  # monotonic, when each run began (before its process existed)

    def _begin(self) -> None:
        self._starts.append(time.monotonic())

    def run_at(self, moment: float) -> str:
        """The run that opened a connection first used at ``moment``: a run's connections all open
        after it began and before the next began (the next starts only once this one was reaped)."""
        return f"{self.name}#{max(1, bisect.bisect_right(self._starts, moment))}"

    @property
    def current(self) -> str:
        return f"{self.name}#{len(self._starts)}"

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
