"""Training progress as the workers report it: world size, last checkpoint, completion.

Every worker's local rank 0 serves ``phalanx.worker`` metrics on its ``phalanx-metrics`` container
port; the rendezvous store pod serves, on its own, whether a rank recorded that training
completed. The poller scrapes, for each job that trains, one ready worker (the lowest index of the
current attempt) and the store, over plain HTTP, every ``interval`` seconds on a timer of the job's
own, a bounded number of jobs at once, taking turns by namespace; it keeps the result per job and
wakes the job when it changed, so the planner writes
``status.workers.worldSize`` and ``status.lastCheckpoint``, ends a completed job, and writes rank
0's progress report, which the store also serves (``parse_reported_progress``), into
``status.progress`` (paced by the planner). No RBAC and
no code in the training pod are needed; the operator must reach pod IPs on that port (a
NetworkPolicy that blocks it only leaves those fields out).

A pod's answer is never trusted: values that are not finite, negative or absurd are dropped,
and whatever goes wrong scraping one pod costs that job its fields and nothing else. The poll
loop itself survives any error, so one bad endpoint never stops progress for every job, and a slow
or silent one holds a single slot for one timeout: other jobs' scrapes never wait for it. A page
is read only as sent (identity encoding: a compressed answer is refused, never inflated), only
up to ``MAX_PAGE_BYTES``, and only its lines of the few series read here are parsed, in a thread;
redirects are not followed, and a pod on its node's network is never scraped (its port is the
node's). A completion record counts only for the job whose UID it names (``Completion.job_uid``).

A sample says when the scrape that read it was sent (the count held at least until then): the
planner judges a hang only on a fresh sample scraped after the deadline ran out, so a reporter that
stops answering (a NetworkPolicy, a port taken after a restart, a network blip) or a scrape that
came late is never taken for a hang; each unanswered scrape counts in
``phalanx_job_progress_scrape_failures_total``.

With a ``StragglerPolicy`` (the node ledger on), each scrape of the store also reads every rank's
step time (``parse_rank_step_times``: this job's, this attempt's, each checked, at most the world
cap) and advances the job's ``reconcile.stragglers`` watch; the job is woken when its stragglers
change, and the planner's pass records them in the node ledger.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import itertools
import logging
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from phalanx import metrics
from phalanx.cluster.cache import ChildCache, JobCache, JobKey
from phalanx.reconcile import naming
from phalanx.reconcile.environment import WORKER_METRICS_PORT
from phalanx.reconcile.observed import Completion, PodRecord, ReportedMetric, ReportedProgress, WorkerProgress
from phalanx.reconcile.status import TRAINING
from phalanx.reconcile.stragglers import RankStepTime, Straggler, StragglerPolicy, StragglerWatch, observe

logger = logging.getLogger(__name__)

WORLD_SIZE = "phalanx_worker_world_size"
STEPS = "phalanx_worker_steps_total"
STEP = "phalanx_worker_step"
RESUMED_STEP = "phalanx_worker_resumed_step"
RUN_START = "phalanx_worker_run_start_timestamp_seconds"
CHECKPOINT_STEP = "phalanx_worker_last_checkpoint_step"
CHECKPOINT_TIME = "phalanx_worker_last_checkpoint_timestamp_seconds"
CHECKPOINT_SAVE_NOW = naming.CHECKPOINT_SAVE_NOW_METRIC
COMPLETED = ("phalanx_training_completed_attempt", "phalanx_training_completed_step", "phalanx_training_completed_rank")
PROGRESS = "phalanx_training_progress_"
PROGRESS_SERIES = tuple(
    PROGRESS + name
    for name in (
        "attempt",
        "step",
        "total_steps",
        "timestamp_seconds",
        "metric",
        "metric_step",
        "metric_timestamp_seconds",
    )
)
METRIC_NAME = re.compile(naming.PROGRESS_METRIC_NAME.removeprefix("^").removesuffix("$"))
RANK_STEP_SECONDS = "phalanx_training_rank_step_seconds"
RANK_STEP = "phalanx_training_rank_step"
STEP_HOST = re.compile(naming.STEP_TIME_HOST)
MAX_METRIC_VALUE = 1e300
MAX_COUNT = 2**53  # steps, ranks, attempts: beyond a float's exact integers a value is garbage
EARLIEST_CHECKPOINT, LATEST_CHECKPOINT = 946684800.0, 7258118400.0  # 2000-01-01 .. 2200-01-01
JOB_LABEL = "job"
"""Label of the completion series: the UID of the job the record names."""
STORE_SCRAPED = ("Running", "Rescaling", "Restarting")
MAX_PAGE_BYTES = 1 << 20
"""A worker's page is a few KiB (a store's a few lines); a longer one is refused unread."""
READ_CHUNK_BYTES = 64 << 10
FRESH_INTERVALS = 3
"""A sample is a verdict for this many poll intervals (and a timeout) after its reporter answered."""


class ProgressError(ValueError):
    """A metrics page that cannot be read at all."""


def _wanted_lines(text: str, wanted: set[str]) -> str:
    """Only the sample lines of the series read here: a page's other lines (a tenant's own
    metrics, however many) are never parsed."""
    kept = []
    for line in io.StringIO(text):  # one line at a time: a page of tiny lines never becomes a list of them
        name = line.split("{", 1)[0].split(None, 1)
        if name and name[0] in wanted:
            kept.append(line.rstrip("\r\n"))
    return "\n".join(kept) + "\n"


def _samples(text: str, names: Iterable[str], *, label: str | None = None) -> dict[str, tuple[float, str]]:
    """The value of each wanted series (with its ``label``'s value, when asked for)."""
    wanted = set(names)
    values: dict[str, tuple[float, str]] = {}
    try:
        for family in text_string_to_metric_families(_wanted_lines(text, wanted)):
            for sample in family.samples:
                if sample.name in wanted:
                    values[sample.name] = (float(sample.value), sample.labels.get(label, "") if label else "")
    except Exception as error:  # the parser raises whatever it meets; none of it is ours to crash on
        raise ProgressError(f"not Prometheus text: {error}") from error
    return values


def _value(values: dict[str, tuple[float, str]], name: str) -> float | None:
    found = values.get(name)
    return found[0] if found is not None else None


def _count(value: float | None, *, minimum: int = 0) -> int | None:
    """A sane integer, or None for a value that is absent, not finite or out of range."""
    if value is None or not math.isfinite(value) or not minimum <= value < MAX_COUNT:
        return None
    return int(value)


def parse_progress(text: str, attempt: int) -> WorkerProgress:
    """Read the world size and the last checkpoint out of a worker's /metrics text."""
    values = _samples(
        text, (WORLD_SIZE, CHECKPOINT_STEP, CHECKPOINT_TIME, CHECKPOINT_SAVE_NOW, STEPS, STEP, RESUMED_STEP, RUN_START)
    )
    world = _count(_value(values, WORLD_SIZE), minimum=1)
    steps = _count(_value(values, STEPS))
    run = _time(_value(values, RUN_START))
    current, resumed = _count(_value(values, STEP)), _count(_value(values, RESUMED_STEP))
    if run is None or current is None or resumed is None or resumed > current:
        run = current = resumed = None  # a run is told by all three, consistent, or not at all
    progress = WorkerProgress(
        attempt=attempt, world_size=world, steps=steps, step=current, resumed_step=resumed, run_started=run
    )
    committed = _time(_value(values, CHECKPOINT_TIME))  # none committed yet (0), or garbage: None
    step = _count(_value(values, CHECKPOINT_STEP))
    if committed is None or step is None:
        return progress
    answered = _count(_value(values, CHECKPOINT_SAVE_NOW), minimum=1)  # 0 (none) or garbage: None
    return replace(progress, checkpoint_step=step, checkpoint_time=committed, checkpoint_save_now=answered)


def _time(value: float | None) -> datetime | None:
    """A Unix time a page gave, or None when it is absent, 0 or absurd."""
    if value is None or not math.isfinite(value) or not EARLIEST_CHECKPOINT <= value <= LATEST_CHECKPOINT:
        return None
    return datetime.fromtimestamp(value, UTC)


def parse_completion(text: str) -> Completion | None:
    """What the rendezvous store says about completion, or None while training is not done.
    The record's job UID comes with it (the ``job`` label): the planner ends only the job it names."""
    values = _samples(text, COMPLETED, label=JOB_LABEL)
    attempt = _count(_value(values, COMPLETED[0]))
    if attempt is None:
        return None
    return Completion(
        attempt=attempt,
        step=_count(_value(values, COMPLETED[1])),
        rank=_count(_value(values, COMPLETED[2])),
        job_uid=values[COMPLETED[0]][1],
    )


def parse_reported_progress(text: str, job_uid: str) -> ReportedProgress | None:
    """Rank 0's progress report out of the store's page: only series labelled with ``job_uid``,
    each value sane, metrics with a valid name and all three of their series, the first
    ``naming.PROGRESS_MAX_METRICS`` by name. None when the page has no whole report of this job."""
    job: dict[str, float] = {}
    metrics: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(_wanted_lines(text, set(PROGRESS_SERIES))):
            for sample in family.samples:
                if sample.labels.get(JOB_LABEL) != job_uid or sample.name not in PROGRESS_SERIES:
                    continue
                field = sample.name.removeprefix(PROGRESS)
                if field.startswith("metric"):
                    name = sample.labels.get("name", "")
                    if METRIC_NAME.fullmatch(name):
                        metrics.setdefault(name, {})[field] = float(sample.value)
                else:
                    job[field] = float(sample.value)
    except Exception as error:  # the parser raises whatever it meets
        raise ProgressError(f"not Prometheus text: {error}") from error
    attempt, step, at = _count(job.get("attempt")), _count(job.get("step")), _time(job.get("timestamp_seconds"))
    if attempt is None or step is None or at is None:
        return None
    reported = []
    for name in sorted(metrics):
        series = metrics[name]
        value, taken, seen = (
            series.get("metric"),
            _count(series.get("metric_step")),
            _time(series.get("metric_timestamp_seconds")),
        )
        finite = value is not None and math.isfinite(value) and abs(value) <= MAX_METRIC_VALUE
        if finite and value is not None and taken is not None and seen is not None:
            reported.append(ReportedMetric(name=name, value=value, step=taken, time=seen))
        if len(reported) == naming.PROGRESS_MAX_METRICS:
            break
    return ReportedProgress(
        job_uid=job_uid,
        attempt=attempt,
        step=step,
        total_steps=_count(job.get("total_steps"), minimum=1),
        time=at,
        metrics=tuple(reported),
    )


def parse_rank_step_times(text: str, job_uid: str, attempt: int, max_ranks: int) -> tuple[RankStepTime, ...]:
    """Each rank's step time out of the store's page, read as untrusted: only series labelled with
    ``job_uid`` and ``attempt``, a rank below ``max_ranks`` (the world cap) with both series, a host
    that is a DNS name, a step time above 0 and at most ``naming.STEP_TIME_MAX_SECONDS``; at most
    ``max_ranks`` ranks, by rank. Anything else is left out, rank by rank."""
    wanted = {RANK_STEP_SECONDS, RANK_STEP}
    cap = max(0, min(max_ranks, naming.STEP_TIME_MAX_RANKS))
    seen: dict[int, dict[str, Any]] = {}
    try:
        for family in text_string_to_metric_families(_wanted_lines(text, wanted)):
            for sample in family.samples:
                labels = sample.labels
                if sample.name not in wanted or labels.get(JOB_LABEL) != job_uid:
                    continue
                if labels.get("attempt") != str(attempt):
                    continue
                rank_text, host = labels.get("rank", ""), labels.get("host", "")
                if not (rank_text.isascii() and rank_text.isdigit() and len(rank_text) <= 5):
                    continue
                if not STEP_HOST.match(host):
                    continue
                rank = int(rank_text)
                if rank >= cap or (rank not in seen and len(seen) >= cap):
                    continue
                entry = seen.setdefault(rank, {"host": host})
                if entry["host"] != host:
                    entry["conflict"] = True  # two hosts claim one rank: neither counts
                entry[sample.name] = float(sample.value)
    except Exception as error:  # the parser raises whatever it meets
        raise ProgressError(f"not Prometheus text: {error}") from error
    found = []
    for rank, entry in sorted(seen.items()):
        seconds, step = entry.get(RANK_STEP_SECONDS), _count(entry.get(RANK_STEP))
        if entry.get("conflict") or seconds is None or step is None:
            continue
        if not (math.isfinite(seconds) and 0 < seconds <= naming.STEP_TIME_MAX_SECONDS):
            continue
        found.append(RankStepTime(rank=rank, host=entry["host"], seconds=seconds, step=step))
    return tuple(found)


def world_cap(body: dict[str, Any]) -> int:
    """The most ranks the job can have, as its spec says (workers.max x procsPerWorker, or x the
    GPUs per worker, as ``resolve_launch`` counts them): read only to bound what is parsed."""
    spec = body.get("spec")
    if not isinstance(spec, dict):
        return 0
    workers, gpus = spec.get("workers"), spec.get("gpus")
    most = workers.get("max") if isinstance(workers, dict) else None
    procs = spec.get("procsPerWorker")
    if not isinstance(procs, int) or isinstance(procs, bool) or procs < 1:
        count = gpus.get("count") if isinstance(gpus, dict) else None
        procs = count if isinstance(count, int) and not isinstance(count, bool) and count >= 1 else 1
    if not isinstance(most, int) or isinstance(most, bool) or most < 1:
        return 0
    return min(most * procs, naming.STEP_TIME_MAX_RANKS)


def metrics_url(pod: PodRecord, port: int) -> str | None:
    """Where a pod serves its metrics; None for a pod that has no IP address of its own (on its
    node's network the port is the node's, which no tenant's pod speaks for)."""
    if pod.host_network or not pod.pod_ip:
        return None
    try:
        address = ipaddress.ip_address(pod.pod_ip)
    except ValueError:
        return None
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"http://{host}:{port}/metrics"


async def read_page(response: aiohttp.ClientResponse, limit: int = MAX_PAGE_BYTES) -> str:
    """A response's body as sent, refused past ``limit`` bytes or in an encoding not asked for."""
    encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ProgressError(f"answered in Content-Encoding {encoding!r}, not the identity asked for")
    if response.content_length is not None and response.content_length > limit:
        raise ProgressError(f"page of {response.content_length} bytes, over the {limit} read")
    body = bytearray()
    async for chunk in response.content.iter_chunked(READ_CHUNK_BYTES):
        body += chunk
        if len(body) > limit:
            raise ProgressError(f"page over the {limit} bytes read")
    try:
        return body.decode()
    except UnicodeDecodeError as error:
        raise ProgressError(f"not UTF-8 text: {error}") from error


def reporting_worker(pods: tuple[PodRecord, ...], attempt: int) -> PodRecord | None:
    """The ready worker of the current attempt with the lowest index and an IP."""
    candidates = [
        pod
        for pod in pods
        if pod.role == naming.ROLE_WORKER
        and pod.attempt == attempt
        and pod.ready
        and pod.active
        and pod.pod_ip
        and not pod.host_network
    ]
    return min(candidates, key=lambda pod: pod.index if pod.index is not None else 1 << 30, default=None)


def _store(pods: tuple[PodRecord, ...]) -> PodRecord | None:
    return next(
        (
            pod
            for pod in pods
            if pod.role == naming.ROLE_RENDEZVOUS and pod.active and pod.ready and pod.pod_ip and not pod.host_network
        ),
        None,
    )


def _content(sample: WorkerProgress) -> WorkerProgress:
    """What a sample says, without when it was read."""
    return replace(sample, scraped_at=None, fresh_until=None, unanswered=0)


def _progress_deadline(body: dict[str, Any]) -> float | None:
    """The job's ``failurePolicy.progressDeadlineSeconds`` (None: no hang detection), read only to
    wake the job with the sample that can judge it; the verdict is the planner's."""
    spec = body.get("spec")
    policy = spec.get("failurePolicy") if isinstance(spec, dict) else None
    value = policy.get("progressDeadlineSeconds") if isinstance(policy, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        return None
    return float(value)


def _first_past_deadline(before: WorkerProgress, now: WorkerProgress, deadline: float | None) -> bool:
    """Whether ``now`` is the first sample of an unchanged count scraped after its deadline ran
    out: the one hang detection can judge (an earlier one shows the count before the deadline)."""
    if deadline is None or now.stepped_since is None or now.scraped_at is None or before.scraped_at is None:
        return False
    due = now.stepped_since + timedelta(seconds=deadline)
    return before.scraped_at < due <= now.scraped_at


class ProgressPoller:
    """Scrapes one worker and the store per training job, each job on a timer of its own;
    ``get``/``completion`` are what the planner sees.

    A job is due ``interval`` after its last scrape began. At most ``concurrency`` jobs are scraped
    at once: a slot that frees goes to the namespace served least recently among those with a job
    due (round robin: one namespace's many jobs never starve another's), and there to a job whose
    endpoints answered last time before one not heard yet or silent, then to the job due longest. Every
    request has its own ``timeout``: an endpoint that never answers holds one slot for that long
    and moves no other job's timer.
    """

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
        stragglers: StragglerPolicy | None = None,
    ) -> None:
        self._jobs = jobs
        self._straggler_policy = stragglers
        self._watches: dict[JobKey, StragglerWatch] = {}
        self._clock = clock
        self._children = children
        self._wake = wake
        self.interval = interval
        self._default_port = default_port
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._timeout_seconds = timeout
        self._concurrency = max(1, concurrency)
        self._latest: dict[JobKey, WorkerProgress] = {}
        self._completed: dict[JobKey, Completion] = {}
        self._reported: dict[JobKey, ReportedProgress] = {}
        self._due: dict[JobKey, float] = {}
        """When (event loop time) each training job is to be scraped next."""
        self._running: dict[JobKey, asyncio.Task[None]] = {}
        self._answering: set[JobKey] = set()
        """Jobs whose last scrape got a readable answer from their worker and store."""
        self._served: dict[str, int] = {}
        """The turn in which each namespace last got a slot."""
        self._turns = itertools.count()
        self._next_scan = -math.inf
        self._session: aiohttp.ClientSession | None = None
        self.errors = 0

    def get(self, key: JobKey) -> WorkerProgress | None:
        return self._latest.get(key)

    def completion(self, key: JobKey) -> Completion | None:
        return self._completed.get(key)

    def reported(self, key: JobKey) -> ReportedProgress | None:
        """Rank 0's latest progress report (kept after the job stops training: its last words)."""
        return self._reported.get(key)

    def stragglers(self, key: JobKey) -> tuple[Straggler, ...]:
        """The ranks of the job's current attempt found persistently slow (none without a policy)."""
        watch = self._watches.get(key)
        return watch.stragglers if watch is not None else ()

    def forget(self, key: JobKey) -> None:
        self._watches.pop(key, None)
        self._latest.pop(key, None)
        self._completed.pop(key, None)
        self._reported.pop(key, None)
        self._due.pop(key, None)
        self._answering.discard(key)

    async def __aenter__(self) -> ProgressPoller:
        # Bodies as sent: a small compressed answer must never be inflated in this process.
        self._session = aiohttp.ClientSession(timeout=self._timeout, auto_decompress=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self) -> None:
        """Scrape each training job on its timer until cancelled; an error is logged and the
        timers go on."""
        async with self:
            try:
                while True:
                    try:
                        wait = self._tick(asyncio.get_running_loop().time())
                    except Exception:
                        self.errors += 1
                        logger.exception("progress poller failed; going on in %.0fs", self.interval)
                        wait = self.interval
                    await self._settle(wait)
            finally:
                for task in self._running.values():
                    task.cancel()
                await asyncio.gather(*self._running.values(), return_exceptions=True)
                self._running.clear()

    async def poll_once(self) -> None:
        """Scrape every training job once now, whatever its timer says, through the same slots
        (inside ``async with``)."""
        now = asyncio.get_running_loop().time()
        self._scan(now)
        for key in self._due:
            self._due[key] = now
        self._start_due(now)
        while self._running:
            await self._settle(math.inf)
            self._start_due(now)

    def _tick(self, now: float) -> float:
        """Start the scrapes that are due and have a slot; the seconds until there is more to do
        (a timer due, new jobs to look for), unless a scrape ends first."""
        if now >= self._next_scan:
            self._scan(now)
        self._start_due(now)
        until = self._next_scan
        if len(self._running) < self._concurrency:
            until = min([until, *(due for key, due in self._due.items() if key not in self._running)])
        return max(0.0, until - now)

    async def _settle(self, seconds: float) -> None:
        """Wait ``seconds`` or until a scrape ends, and let go of the scrapes that ended."""
        if self._running:
            await asyncio.wait(
                self._running.values(),
                timeout=None if seconds == math.inf else seconds,
                return_when=asyncio.FIRST_COMPLETED,
            )
        elif seconds != math.inf:
            await asyncio.sleep(seconds)
        self._running = {key: task for key, task in self._running.items() if not task.done()}

    def _scan(self, now: float) -> None:
        """A timer, due at once, for each job that came to train; none for jobs that stopped."""
        training = {
            key
            for key in self._jobs.keys()  # noqa: SIM118 - JobCache, not a dict
            if ((self._jobs.get(key) or {}).get("status") or {}).get("phase") in STORE_SCRAPED
        }
        for key in self._due.keys() - training:
            del self._due[key]
            self._answering.discard(key)
        for key in training:
            self._due.setdefault(key, now)
        self._next_scan = now + self.interval

    def _start_due(self, now: float) -> None:
        """Give free slots to jobs due by ``now``, fairly (see the class)."""
        free = self._concurrency - len(self._running)
        if free <= 0:
            return
        waiting: dict[str, list[tuple[bool, float, JobKey]]] = {}
        for key, due in self._due.items():
            if due <= now and key not in self._running:
                waiting.setdefault(key[0], []).append((key not in self._answering, due, key))
        queues = [sorted(waiting[namespace]) for namespace in sorted(waiting, key=self._last_served)]
        chosen: list[JobKey] = []
        for rank in range(max(map(len, queues), default=0)):  # one job of each namespace in turn
            chosen += [queue[rank][2] for queue in queues if rank < len(queue)]
            if len(chosen) >= free:
                break
        for key in chosen[:free]:
            self._served[key[0]] = next(self._turns)
            self._due[key] = asyncio.get_running_loop().time() + self.interval
            self._running[key] = asyncio.create_task(self._scrape_job(key), name=f"progress of {key[0]}/{key[1]}")

    def _last_served(self, namespace: str) -> tuple[int, str]:
        return self._served.get(namespace, -1), namespace

    async def _scrape_job(self, key: JobKey) -> None:
        """One job's reporting worker and store, as the caches show the job now."""
        try:
            body = self._jobs.get(key)
            status = (body or {}).get("status") or {}
            phase = status.get("phase")
            if body is None or phase not in STORE_SCRAPED:
                return
            try:
                attempt = int(status.get("attempt") or 0)
            except (TypeError, ValueError):
                return
            pods = self._children.pods_of(key[0], str(body["metadata"].get("uid", "")))
            worker = reporting_worker(pods, attempt) if phase in TRAINING else None
            store = _store(pods)
            scrapes = []
            if worker is not None:
                scrapes.append(self._scrape_worker(key, worker, attempt, _progress_deadline(body)))
            if phase not in TRAINING:
                self._watches.pop(key, None)  # no straggler outlives the attempt's training
            if store is not None:
                step_times = (attempt, world_cap(body)) if phase in TRAINING else None
                scrapes.append(self._scrape_store(key, store, str(body["metadata"].get("uid", "")), step_times))
            answered = await asyncio.gather(*scrapes)
            if key in self._due and all(answered):
                self._answering.add(key)
            else:
                self._answering.discard(key)
        except Exception:  # one job's scrape never stops the others'
            self.errors += 1
            logger.exception("progress scrape of %s/%s failed", *key)

    async def _fetch(self, pod: PodRecord) -> str | None:
        """The pod's page, or None when it gives no readable one (ProgressError: a hostile one)."""
        assert self._session is not None
        url = metrics_url(pod, pod.metrics_port or self._default_port)
        if url is None:
            return None
        try:
            async with self._session.get(
                url, headers={"Accept-Encoding": "identity"}, allow_redirects=False
            ) as response:
                if response.status != 200:
                    return None
                return await read_page(response)
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            logger.debug("no metrics from %s (%s): %s", pod.name, url, error)
            return None

    def _unanswered(self, key: JobKey, target: str) -> None:
        metrics.PROGRESS_SCRAPE_FAILURES.labels(key[0], key[1], target).inc()

    async def _scrape_worker(self, key: JobKey, pod: PodRecord, attempt: int, deadline: float | None) -> bool:
        """File what the worker says; whether it answered readably."""
        # The page shows the worker as of some moment after the request left: a count read in it
        # held at least until then (``scraped_at``), and changed no later than the answer came.
        sent = self._clock()
        try:
            text = await self._fetch(pod)
            progress = await asyncio.to_thread(parse_progress, text, attempt) if text is not None else None
        except Exception as error:  # one pod's answer never affects another job
            self.errors += 1
            logger.warning("unreadable metrics from %s: %s", pod.name, error)
            progress = None
        if self._jobs.get(key) is None:
            return True  # deleted while its worker was asked: keep nothing of it
        before = self._latest.get(key)
        if progress is None:
            self._unanswered(key, "worker")
            if before is not None and before.reporter == pod.uid:
                self._keep(key, before, replace(before, unanswered=before.unanswered + 1))
            return False
        progress = replace(
            progress,
            reporter=pod.uid,
            scraped_at=sent,
            fresh_until=sent + timedelta(seconds=FRESH_INTERVALS * self.interval + self._timeout_seconds),
        )
        self._keep(key, before, self._with_step_clock(before, progress, seen=self._clock()), deadline)
        return True

    def _keep(
        self, key: JobKey, before: WorkerProgress | None, now: WorkerProgress, deadline: float | None = None
    ) -> None:
        """File a sample; wake the job when it says something new. A newer answer with the same
        content wakes nobody, but the one that ends a silence does, and so does the first one
        scraped after the count's deadline ran out: the planner judges a hang only on fresh
        samples taken after the deadline (and its own requeue brings it back otherwise)."""
        self._latest[key] = now
        if (
            before is None
            or _content(before) != _content(now)
            or self._stale(before) != self._stale(now)
            or _first_past_deadline(before, now, deadline)
        ):
            self._wake(key)

    def _stale(self, sample: WorkerProgress) -> bool:
        return sample.fresh_until is None or self._clock() > sample.fresh_until

    def _with_step_clock(self, before: WorkerProgress | None, now: WorkerProgress, *, seen: datetime) -> WorkerProgress:
        """Keep when the step count was first seen at its value (``seen``: when the answer came,
        the latest the count can have changed); any change (a new step, another reporting pod or
        attempt, a restarted process whose counter began again) restarts that clock. A clock never
        starts before this process first saw the count, so an operator restart can only delay a
        NoProgress verdict, never hasten it."""
        if now.steps is None:
            return now
        same = before is not None and (before.attempt, before.reporter, before.steps) == (
            now.attempt,
            now.reporter,
            now.steps,
        )
        return replace(now, stepped_since=before.stepped_since if same and before is not None else seen)

    async def _scrape_store(
        self, key: JobKey, pod: PodRecord, job_uid: str, step_times: tuple[int, int] | None = None
    ) -> bool:
        """File what the store says about completion and rank 0's progress (and, given the
        ``(attempt, world cap)`` of a training job, the ranks' step times); whether it answered
        readably."""
        times: tuple[RankStepTime, ...] | None = None
        try:
            text = await self._fetch(pod)
            completion, reported = (
                await asyncio.to_thread(_store_page, text, job_uid) if text is not None else (None, None)
            )
            if text is not None and step_times is not None and self._straggler_policy is not None:
                times = await asyncio.to_thread(parse_rank_step_times, text, job_uid, *step_times)
        except Exception as error:
            self.errors += 1
            logger.warning("unreadable status from %s: %s", pod.name, error)
            text = completion = reported = times = None
        if self._jobs.get(key) is None:
            return True  # deleted meanwhile: no series of it comes back
        if text is None:
            self._unanswered(key, "store")
            return False
        if completion is not None and self._completed.get(key) != completion:
            self._completed[key] = completion
            self._wake(key)
        if reported is not None and self._reported.get(key) != reported:
            self._reported[key] = reported
            self._wake(key)  # the planner paces the status writes (plan.progress_report)
        if times is not None and step_times is not None and self._straggler_policy is not None:
            before = self.stragglers(key)
            self._watches[key] = observe(self._watches.get(key), step_times[0], times, self._straggler_policy)
            if [(one.rank, one.host) for one in before] != [(one.rank, one.host) for one in self.stragglers(key)]:
                self._wake(key)  # the pass records a new straggler in the node ledger
        return True


def _store_page(text: str, job_uid: str) -> tuple[Completion | None, ReportedProgress | None]:
    return parse_completion(text), parse_reported_progress(text, job_uid)
