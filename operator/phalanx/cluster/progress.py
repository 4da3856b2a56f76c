"""Training progress as the workers report it: world size, last checkpoint, completion.

Every worker's local rank 0 serves ``phalanx.worker`` metrics on its ``phalanx-metrics`` container
port; the rendezvous store pod serves, on its own, whether a rank recorded that training
completed. Every ``interval`` seconds the poller scrapes, for each job that trains, one ready
worker (the lowest index of the current attempt) and the store, over plain HTTP; it keeps the
result per job and wakes the job when it changed, so the planner writes
``status.workers.worldSize`` and ``status.lastCheckpoint``, and ends a completed job. No RBAC and
no code in the training pod are needed; the operator must reach pod IPs on that port (a
NetworkPolicy that blocks it only leaves those fields out).

A pod's answer is never trusted: values that are not finite, negative or absurd are dropped,
and whatever goes wrong scraping one pod costs that job its fields and nothing else. The poll
loop itself survives any error, so one bad endpoint never stops progress for every job.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import UTC, datetime

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from phalanx.cluster.cache import ChildCache, JobCache, JobKey
from phalanx.reconcile import naming
from phalanx.reconcile.environment import WORKER_METRICS_PORT
from phalanx.reconcile.observed import Completion, PodRecord, WorkerProgress
from phalanx.reconcile.plan import TRAINING

logger = logging.getLogger(__name__)

WORLD_SIZE = "phalanx_worker_world_size"
STEPS = "phalanx_worker_steps_total"
CHECKPOINT_STEP = "phalanx_worker_last_checkpoint_step"
CHECKPOINT_TIME = "phalanx_worker_last_checkpoint_timestamp_seconds"
COMPLETED = ("phalanx_training_completed_attempt", "phalanx_training_completed_step", "phalanx_training_completed_rank")
MAX_COUNT = 2**53  # steps, ranks, attempts: beyond a float's exact integers a value is garbage
EARLIEST_CHECKPOINT, LATEST_CHECKPOINT = 946684800.0, 7258118400.0  # 2000-01-01 .. 2200-01-01
STORE_SCRAPED = ("Running", "Rescaling", "Restarting")


class ProgressError(ValueError):
    """A metrics page that cannot be read at all."""


def _samples(text: str, names: Iterable[str]) -> dict[str, float]:
    wanted = set(names)
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    values[sample.name] = float(sample.value)
    except Exception as error:  # the parser raises whatever it meets; none of it is ours to crash on
        raise ProgressError(f"not Prometheus text: {error}") from error
    return values


def _count(value: float | None, *, minimum: int = 0) -> int | None:
    """A sane integer, or None for a value that is absent, not finite or out of range."""
    if value is None or not math.isfinite(value) or not minimum <= value < MAX_COUNT:
        return None
    return int(value)


def parse_progress(text: str, attempt: int) -> WorkerProgress:
    """Read the world size and the last checkpoint out of a worker's /metrics text."""
    values = _samples(text, (WORLD_SIZE, CHECKPOINT_STEP, CHECKPOINT_TIME, STEPS))
    world = _count(values.get(WORLD_SIZE), minimum=1)
    steps = _count(values.get(STEPS))
    committed = values.get(CHECKPOINT_TIME)
    step = _count(values.get(CHECKPOINT_STEP))
    if committed is None or not math.isfinite(committed) or not EARLIEST_CHECKPOINT <= committed <= LATEST_CHECKPOINT:
        return WorkerProgress(attempt=attempt, world_size=world, steps=steps)  # none committed yet (0), or garbage
    if step is None:
        return WorkerProgress(attempt=attempt, world_size=world, steps=steps)
    return WorkerProgress(
        attempt=attempt,
        world_size=world,
        checkpoint_step=step,
        checkpoint_time=datetime.fromtimestamp(committed, UTC),
        steps=steps,
    )


def parse_completion(text: str) -> Completion | None:
    """What the rendezvous store says about completion, or None while training is not done."""
    values = _samples(text, COMPLETED)
    attempt = _count(values.get(COMPLETED[0]))
    if attempt is None:
        return None
    return Completion(attempt=attempt, step=_count(values.get(COMPLETED[1])), rank=_count(values.get(COMPLETED[2])))


def reporting_worker(pods: tuple[PodRecord, ...], attempt: int) -> PodRecord | None:
    """The ready worker of the current attempt with the lowest index and an IP."""
    candidates = [
        pod
        for pod in pods
        if pod.role == naming.ROLE_WORKER and pod.attempt == attempt and pod.ready and pod.active and pod.pod_ip
    ]
    return min(candidates, key=lambda pod: pod.index if pod.index is not None else 1 << 30, default=None)


def _store(pods: tuple[PodRecord, ...]) -> PodRecord | None:
    return next(
        (pod for pod in pods if pod.role == naming.ROLE_RENDEZVOUS and pod.active and pod.ready and pod.pod_ip), None
    )


class ProgressPoller:
    """Scrapes one worker and the store per training job; ``get``/``completion`` are what the
    planner sees."""

    def __init__(
        self,
        jobs: JobCache,
        children: ChildCache,
        wake: Callable[[JobKey], None],
        *,
        interval: float,
        timeout: float = 2.0,
        concurrency: int = 8,
        default_port: int = WORKER_METRICS_PORT,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._jobs = jobs
        self._clock = clock
        self._children = children
        self._wake = wake
        self.interval = interval
        self._default_port = default_port
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._slots = asyncio.Semaphore(concurrency)
        self._latest: dict[JobKey, WorkerProgress] = {}
        self._completed: dict[JobKey, Completion] = {}
        self._session: aiohttp.ClientSession | None = None
        self.errors = 0

    def get(self, key: JobKey) -> WorkerProgress | None:
        return self._latest.get(key)

    def completion(self, key: JobKey) -> Completion | None:
        return self._completed.get(key)

    def forget(self, key: JobKey) -> None:
        self._latest.pop(key, None)
        self._completed.pop(key, None)

    async def __aenter__(self) -> ProgressPoller:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self) -> None:
        """Poll until cancelled; an error in one round is logged and the next round comes."""
        async with self:
            while True:
                try:
                    await self.poll_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.errors += 1
                    logger.exception("progress poll failed; polling again in %.0fs", self.interval)
                await asyncio.sleep(self.interval)

    async def poll_once(self) -> None:
        """Scrape every training job's reporting worker and store once (inside ``async with``)."""
        scrapes = []
        for key in self._jobs.keys():  # noqa: SIM118 - JobCache, not a dict
            body = self._jobs.get(key) or {}
            status = body.get("status") or {}
            phase = status.get("phase")
            if phase not in STORE_SCRAPED:
                continue
            try:
                attempt = int(status.get("attempt") or 0)
            except (TypeError, ValueError):
                continue
            pods = self._children.pods_of(key[0], str(body["metadata"].get("uid", "")))
            worker = reporting_worker(pods, attempt) if phase in TRAINING else None
            if worker is not None:
                scrapes.append(self._scrape_worker(key, worker, attempt))
            store = _store(pods)
            if store is not None:
                scrapes.append(self._scrape_store(key, store))
        await asyncio.gather(*scrapes)

    async def _fetch(self, pod: PodRecord) -> str | None:
        assert self._session is not None
        url = f"http://{pod.pod_ip}:{pod.metrics_port or self._default_port}/metrics"
        async with self._slots:
            try:
                async with self._session.get(url) as response:
                    if response.status != 200:
                        return None
                    return await response.text()
            except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError) as error:
                logger.debug("no metrics from %s (%s): %s", pod.name, url, error)
                return None

    async def _scrape_worker(self, key: JobKey, pod: PodRecord, attempt: int) -> None:
        try:
            text = await self._fetch(pod)
            if text is None:
                return
            progress = parse_progress(text, attempt)
        except Exception as error:  # one pod's answer never affects another job
            self.errors += 1
            logger.warning("unreadable metrics from %s: %s", pod.name, error)
            return
        if self._jobs.get(key) is None:
            return  # deleted while its worker was asked: keep nothing of it
        progress = self._with_step_clock(self._latest.get(key), replace(progress, reporter=pod.uid))
        if self._latest.get(key) != progress:
            self._latest[key] = progress
            self._wake(key)

    def _with_step_clock(self, before: WorkerProgress | None, now: WorkerProgress) -> WorkerProgress:
        """Keep when the step count was first seen at its value; any change (a new step, another
        reporting pod or attempt, a restarted process whose counter began again) restarts that clock.
        A clock never starts before this process first saw the count, so an operator restart can
        only delay a NoProgress verdict, never hasten it."""
        if now.steps is None:
            return now
        same = before is not None and (before.attempt, before.reporter, before.steps) == (
            now.attempt,
            now.reporter,
            now.steps,
        )
        return replace(now, stepped_since=before.stepped_since if same and before is not None else self._clock())

    async def _scrape_store(self, key: JobKey, pod: PodRecord) -> None:
        try:
            text = await self._fetch(pod)
            if text is None:
                return
            completion = parse_completion(text)
        except Exception as error:
            self.errors += 1
            logger.warning("unreadable status from %s: %s", pod.name, error)
            return
        if self._jobs.get(key) is None:
            return
        if completion is not None and self._completed.get(key) != completion:
            self._completed[key] = completion
            self._wake(key)
