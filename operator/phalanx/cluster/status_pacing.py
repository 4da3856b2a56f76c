"""When a status write that only reports progress goes out: the pacing of each job's status writes.

A decision (a new phase, a failure counted, a slot claimed) is always written at once; a write that
only moves counts and progress waits out an interval since the job's last write (``StatusPacer``),
and ``cluster.apply`` holds it back until then.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from phalanx.cluster.cache import JobKey

PROGRESS_WRITE_SECONDS = 5.0  # PHALANX_STATUS_PROGRESS_SECONDS
STARTUP_PROGRESS_WRITE_SECONDS = 15.0
BUSY_PROGRESS_WRITE_SECONDS = 30.0
STARTING_PHASES = ("Pending", "Starting")  # phases paced at STARTUP_PROGRESS_WRITE_SECONDS


class StatusPacer:
    """When each job's status was last written: a write that only reports progress (plan.progress_only)
    goes out at most once per ``interval`` and carries what changed meanwhile, so a gang of pods
    starting one by one costs one write, not one per pod. A job starting up (Pending, Starting)
    reports its counts at most every ``startup_interval``: its phase says what happens, and the
    next phase comes soon. While the operator is ``busy`` (jobs wait in its queue), progress waits
    up to ``busy_interval``: the requests go to creating what jobs need. Decisions are never held
    back."""

    def __init__(
        self,
        interval: float = PROGRESS_WRITE_SECONDS,
        *,
        startup_interval: float = STARTUP_PROGRESS_WRITE_SECONDS,
        busy_interval: float = BUSY_PROGRESS_WRITE_SECONDS,
        busy: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.startup_interval = startup_interval
        self.busy_interval = busy_interval
        self.busy = busy
        self._clock = clock
        self._written: dict[JobKey, float] = {}

    def hold(self, key: JobKey, *, starting: bool = False) -> float:
        """Seconds a progress-only write of this job should still wait (0: write now)."""
        written = self._written.get(key)
        if written is None:
            return 0.0
        interval = max(self.interval, self.startup_interval) if starting else self.interval
        if self.busy():
            interval = max(interval, self.busy_interval)
        return max(0.0, written + interval - self._clock())

    def wrote(self, key: JobKey) -> None:
        self._written[key] = self._clock()

    def forget(self, key: JobKey) -> None:
        self._written.pop(key, None)
