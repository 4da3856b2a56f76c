"""Stop what the tests started also when pytest itself is stopped.

A fixture's ``finally`` does not run when pytest gets SIGTERM or SIGHUP (CI cancelling a job,
a closed terminal): the default action ends the process at once, and processes started in
their own sessions (control plane, kubelet, operator, a build daemon) would outlive it. The
handler installed here turns the first such signal into a KeyboardInterrupt, so the stack
unwinds as on Ctrl-C and pytest tears its fixtures down; a second signal stops whatever is
registered with :func:`stopped_on_exit` (newest first) and ends the process at once. A signal
that arrives while a stop runs waits until it is done: an interrupted stop would leave the rest of
what it stops running, with nothing left to stop it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

_stops: list[Callable[[], None]] = []
_installed = threading.Event()
_unwinding = threading.Event()
_lock = threading.Lock()
_stopping: list[Callable[[], None]] = []  # stops running now (signal handlers run in the main thread)
_deferred: list[int] = []  # a signal that came during a stop


def _stop_all() -> None:
    while _stops:
        stop = _stops.pop()
        with contextlib.suppress(Exception):  # one failing stop must not spare the others
            stop()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _unwinding.is_set():  # a second signal: stop what is registered and end now
        _stop_all()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    if _stopping:
        _deferred.append(signum)
        return
    _unwinding.set()
    # Unwind like Ctrl-C: every ``finally`` and context manager on the way runs (a half-started
    # node, a build daemon), and pytest tears down its fixtures before it exits.
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def _install() -> None:
    with _lock:
        if _installed.is_set():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # only the main thread may set handlers
                signal.signal(sig, _on_signal)
        atexit.register(_stop_all)
        _installed.set()


@contextlib.contextmanager
def stopped_on_exit(stop: Callable[[], None]) -> Iterator[None]:
    """Call ``stop`` exactly once: when the block ends, on SIGTERM/SIGHUP, or at interpreter exit."""
    done = False

    def once() -> None:
        nonlocal done
        if done:
            return
        done = True
        _stopping.append(stop)
        try:
            stop()
        finally:
            _stopping.remove(stop)
        if _deferred and not _stopping:
            _on_signal(_deferred.pop(), None)

    _install()
    _stops.append(once)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _stops.remove(once)
        once()
