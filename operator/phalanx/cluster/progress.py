"""Training progress as the workers report it: world size and last checkpoint.

Every worker's local rank 0 serves ``phalanx.worker`` metrics on PHALANX_WORKER_METRICS_PORT.
Every ``interval`` seconds the poller scrapes one ready worker of each training job (the
lowest index of the current attempt) over plain HTTP, keeps the result per job and wakes the
job when it changed, so the planner writes ``status.workers.worldSize`` and
``status.lastCheckpoint``. No RBAC and no code in the training pod are needed; the operator
must reach pod IPs on that port (a NetworkPolicy that blocks it only leaves those fields out).
One small GET per training job and interval, a few in flight at a time, short timeouts: a
worker that does not answer costs nothing but its absent fields.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from phalanx.cluster.cache import ChildCache, JobCache, JobKey
from phalanx.reconcile import naming
from phalanx.reconcile.observed import PodRecord, WorkerProgress
from phalanx.reconcile.plan import TRAINING

logger = logging.getLogger(__name__)

WORLD_SIZE = "phalanx_worker_world_size"
CHECKPOINT_STEP = "phalanx_worker_last_checkpoint_step"
CHECKPOINT_TIME = "phalanx_worker_last_checkpoint_timestamp_seconds"


def parse_progress(text: str, attempt: int) -> WorkerProgress:
    """Read the world size and the last checkpoint out of a worker's /metrics text."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (WORLD_SIZE, CHECKPOINT_STEP, CHECKPOINT_TIME):
                values[sample.name] = sample.value
    world = int(values.get(WORLD_SIZE, 0)) or None
    committed = values.get(CHECKPOINT_TIME, 0.0)
    if committed <= 0:  # no checkpoint committed by this worker process yet
        return WorkerProgress(attempt=attempt, world_size=world)
    return WorkerProgress(
        attempt=attempt,
        world_size=world,
        checkpoint_step=int(values.get(CHECKPOINT_STEP, 0)),
        checkpoint_time=datetime.fromtimestamp(committed, UTC),
    )


def reporting_worker(pods: tuple[PodRecord, ...], attempt: int) -> PodRecord | None:
    """The ready worker of the current attempt with the lowest index and an IP."""
    candidates = [
        pod
        for pod in pods
        if pod.role == naming.ROLE_WORKER and pod.attempt == attempt and pod.ready and pod.active and pod.pod_ip
    ]
    return min(candidates, key=lambda pod: pod.index if pod.index is not None else 1 << 30, default=None)


class ProgressPoller:
    """Scrapes one worker per training job; ``get(key)`` is what the planner sees."""

    def __init__(
        self,
        jobs: JobCache,
        children: ChildCache,
        wake: Callable[[JobKey], None],
        *,
        port: int,
        interval: float,
        timeout: float = 2.0,
        concurrency: int = 8,
    ) -> None:
        self._jobs = jobs
        self._children = children
        self._wake = wake
        self._port = port
        self.interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._slots = asyncio.Semaphore(concurrency)
        self._latest: dict[JobKey, WorkerProgress] = {}
        self._session: aiohttp.ClientSession | None = None

    def get(self, key: JobKey) -> WorkerProgress | None:
        return self._latest.get(key)

    def forget(self, key: JobKey) -> None:
        self._latest.pop(key, None)

    async def __aenter__(self) -> ProgressPoller:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self) -> None:
        """Poll until cancelled."""
        async with self:
            while True:
                await self.poll_once()
                await asyncio.sleep(self.interval)

    async def poll_once(self) -> None:
        """Scrape every training job's reporting worker once (inside ``async with poller``)."""
        targets: list[tuple[JobKey, PodRecord, int]] = []
        known = self._jobs.keys()
        for key in known:
            body = self._jobs.get(key) or {}
            status = body.get("status") or {}
            if status.get("phase") not in TRAINING:
                continue
            attempt = int(status.get("attempt") or 0)
            pod = reporting_worker(self._children.observed(key, frozenset()).pods, attempt)
            if pod is not None:
                targets.append((key, pod, attempt))
        await asyncio.gather(*(self._scrape(key, pod, attempt) for key, pod, attempt in targets))

    async def _scrape(self, key: JobKey, pod: PodRecord, attempt: int) -> None:
        assert self._session is not None
        url = f"http://{pod.pod_ip}:{self._port}/metrics"
        async with self._slots:
            try:
                async with self._session.get(url) as response:
                    if response.status != 200:
                        return
                    text = await response.text()
            except (aiohttp.ClientError, TimeoutError, OSError) as error:
                logger.debug("no progress from %s (%s): %s", pod.name, url, error)
                return
        try:
            progress = parse_progress(text, attempt)
        except ValueError as error:
            logger.debug("unreadable metrics from %s: %s", pod.name, error)
            return
        if self._latest.get(key) != progress:
            self._latest[key] = progress
            self._wake(key)
