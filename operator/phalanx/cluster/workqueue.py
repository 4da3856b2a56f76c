"""A keyed work queue: coalescing, one pass at a time per key, bounded concurrency, delays.

Watch events only name the job that needs a look; many events for one job collapse
into one pass, and a job is never reconciled by two passes at once. A pass returns how
long until it wants to run again (backoff, deadlines, TTL); a failing pass is retried
with exponential backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
ERROR_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class WorkQueue(Generic[K]):
    """Runs ``handler(key)`` for enqueued keys."""

    def __init__(self, handler: Callable[[K], Awaitable[float | None]], *, workers: int = 8) -> None:
        self._handler = handler
        self._workers = workers
        self._ready: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()
        self._running: set[K] = set()
        self._dirty: set[K] = set()
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._errors: dict[K, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.idle = asyncio.Event()
        self.idle.set()

    def enqueue(self, key: K, delay: float = 0.0) -> None:
        """Ask for a pass over ``key`` now or after ``delay`` seconds."""
        if delay > 0:
            loop = asyncio.get_running_loop()
            timer = self._timers.get(key)
            due = loop.time() + delay
            if timer is not None and timer.when() <= due:
                return
            if timer is not None:
                timer.cancel()
            self._timers[key] = loop.call_at(due, self._fire, key)
            return
        if key in self._running:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self.idle.clear()
            self._ready.put_nowait(key)

    def backlog(self) -> int:
        """Keys waiting for a free worker."""
        return self._ready.qsize()

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.enqueue(key)

    def forget(self, key: K) -> None:
        """Drop timers and error history of a key that no longer exists."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._errors.pop(key, None)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work(), name=f"phalanx-worker-{i}") for i in range(self._workers)]

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _work(self) -> None:
        while True:
            key = await self._ready.get()
            self._queued.discard(key)
            self._running.add(key)
            try:
                again = await self._handler(key)
            except asyncio.CancelledError:
                raise
            except Exception:
                failures = self._errors.get(key, 0)
                self._errors[key] = failures + 1
                delay = ERROR_DELAYS[min(failures, len(ERROR_DELAYS) - 1)]
                logger.exception("reconcile of %s failed; retrying in %.0fs", key, delay)
                self.enqueue(key, delay)
            else:
                self._errors.pop(key, None)
                if again is not None:
                    self.enqueue(key, max(again, 0.05))
            finally:
                self._running.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)
                if not self._queued and not self._running:
                    self.idle.set()
