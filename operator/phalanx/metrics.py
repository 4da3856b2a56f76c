"""Prometheus metrics of the operator process.

Reconcile-loop metrics reuse controller-runtime's names so stock controller dashboards work.
Per-job series are labelled by namespace and job name only (never pods or UIDs) and are
removed when the job is deleted, so cardinality stays bounded by live jobs. The startup
histogram is labelled by namespace only: a histogram per job would multiply series by buckets.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pydantic
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from phalanx.api import v1alpha1 as api
from phalanx.reconcile.goodput import effective_training_ratio, seconds_by_state
from phalanx.reconcile.status import parse_time

RECONCILE_TOTAL = Counter("controller_runtime_reconcile_total", "Reconcile passes by result.", ["controller", "result"])
RECONCILE_ERRORS = Counter("controller_runtime_reconcile_errors_total", "Reconcile passes that raised.", ["controller"])
RECONCILE_TIME = Histogram(
    "controller_runtime_reconcile_time_seconds",
    "Duration of one reconcile pass.",
    ["controller"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

PHASES = ("Pending", "Starting", "Running", "Rescaling", "Restarting", "Succeeded", "Failed", "Suspended")
TRAINING = ("Running", "Rescaling")
JOB = ["namespace", "name"]

JOBS = Gauge("phalanx_jobs", "TrainingJobs by phase.", ["phase"])
JOB_PHASE = Gauge("phalanx_job_phase", "1 for the job's current phase, 0 for the others.", [*JOB, "phase"])
WORKERS_DESIRED = Gauge("phalanx_job_workers_desired", "Workers the job aims for.", JOB)
WORKERS_READY = Gauge("phalanx_job_workers_ready", "Ready workers of the current attempt.", JOB)
SPARES_READY = Gauge(
    "phalanx_job_spares_ready", "Warm spare pods running, ready to take a lost worker's slot (workers.spares).", JOB
)
GPUS_HELD_BY_SPARES = Gauge(
    "phalanx_job_gpus_held_by_spares", "GPUs held by the job's spare pods bound to nodes: what spares cost.", JOB
)
WORLD_SIZE = Gauge(
    "phalanx_job_world_size", "Workers in the training world (ready workers while training, else 0).", JOB
)
GPUS_REQUESTED = Gauge("phalanx_job_gpus_requested", "GPUs the job's desired workers request.", JOB)
GPUS_BOUND = Gauge("phalanx_job_gpus_bound", "GPUs held by the job's workers that are bound to nodes.", JOB)
RESTART_BUDGET_USED = Gauge(
    "phalanx_job_restart_budget_used", "Counted restarts, compared with failurePolicy.maxRestarts.", JOB
)
RESTART_BUDGET_LIMIT = Gauge(
    "phalanx_job_restart_budget_limit", "Counted restarts allowed (failurePolicy.maxRestarts) before failing.", JOB
)
RESTARTS = Counter("phalanx_job_restarts_total", "Worker replacements and gang restarts by reason.", [*JOB, "reason"])
RESCALES = Counter("phalanx_job_rescales_total", "Changes of the desired worker count.", [*JOB, "direction"])
GOODPUT = Gauge("phalanx_job_goodput_ratio", "Time spent training over wall time since creation (0..1).", JOB)
TRAINING_STEP = Gauge("phalanx_job_training_step", "The training step rank 0 last reported (status.progress).", JOB)
TRAINING_PERCENT = Gauge(
    "phalanx_job_training_progress_percent", "Reported step over totalSteps, in percent (status.progress).", JOB
)
TRAINING_ETA = Gauge(
    "phalanx_job_training_eta_seconds",
    "Seconds of training left at the recent rate of steps (status.progress); absent when unknown.",
    JOB,
)
STARTUP = Histogram(
    "phalanx_job_startup_duration_seconds",
    "Time from a job's creation until it first trained.",
    ["namespace"],
    buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200),
)
PROGRESS_SCRAPE_FAILURES = Counter(
    "phalanx_job_progress_scrape_failures_total",
    "Scrapes of a job's reporting worker or rendezvous store that got no readable answer.",
    [*JOB, "target"],
)
PROGRESS_TARGETS = ("worker", "store")
NODE_LEDGER_NODES = Gauge(
    "phalanx_node_ledger_nodes",
    'Nodes in the cluster-wide node ledger: "scored" (any evidence not yet decayed), "avoided" (past the threshold).',
    ["state"],
)
LEADER = Gauge("phalanx_leader", "1 while this replica holds the leader Lease and reconciles; 0 while it stands by.")
WATCH_RELISTS = Counter(
    "phalanx_watch_relists_total",
    "Lists of a watched resource after the first (410 Gone, a resource that reappeared).",
    ["resource"],
)
WATCH_SYNCED = Gauge(
    "phalanx_watch_synced", "1 while every watch of the resource has a complete list in hand.", ["resource"]
)
WATCH_SCOPE_SYNCED = Gauge(
    "phalanx_watch_scope_synced",
    '1 when every watch a namespace\'s jobs need ("cluster": a cluster-wide watch) is synced; its jobs wait otherwise.',
    ["namespace"],
)


class JobTimeCollector:
    """Each job's time by state (``status.timeByState``) as of the scrape, the current state's
    running time included (``phalanx_job_state_seconds_total``, ``phalanx_job_effective_training_ratio``),
    its steps computed again after restarts (``phalanx_job_recomputed_steps_total``) and the work
    saving on a notice kept (``phalanx_job_notice_saved_gpu_seconds_total``)."""

    def __init__(self, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self._jobs: dict[tuple[str, str], api.TimeByState] = {}
        self._recomputed: dict[tuple[str, str], int] = {}
        self._saved: dict[tuple[str, str], int] = {}
        self._clock = clock

    def observe(self, key: tuple[str, str], status: Mapping[str, Any]) -> None:
        """Take a job's status (the keys a pass left out are taken as they were)."""
        try:
            if status.get("timeByState"):
                self._jobs[key] = api.TimeByState.model_validate(status["timeByState"])
            if status.get("recomputedSteps"):
                self._recomputed[key] = api.RecomputedSteps.model_validate(status["recomputedSteps"]).total
            if status.get("noticeSavings"):
                self._saved[key] = api.NoticeSavings.model_validate(status["noticeSavings"]).gpu_seconds
        except pydantic.ValidationError:
            return  # written by another version: the last good one stays

    def forget(self, key: tuple[str, str]) -> None:
        self._jobs.pop(key, None)
        self._recomputed.pop(key, None)
        self._saved.pop(key, None)

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        seconds = CounterMetricFamily(
            "phalanx_job_state_seconds",
            "Seconds the job spent queued, starting, training, recovering (by the gang restart's cause) or suspended.",
            labels=[*JOB, "state", "cause"],
        )
        ratio = GaugeMetricFamily(
            "phalanx_job_effective_training_ratio",
            "Training time over the job's time so far, suspension left out (0..1).",
            labels=JOB,
        )
        recomputed = CounterMetricFamily(
            "phalanx_job_recomputed_steps",
            "Training steps computed again after worker replacements and gang restarts.",
            labels=JOB,
        )
        for (namespace, name), counts in list(self._jobs.items()):
            for (state, cause), spent in sorted(seconds_by_state(counts, now).items()):
                seconds.add_metric([namespace, name, state, cause], spent)
            ratio.add_metric([namespace, name], effective_training_ratio(counts, now))
        saved = CounterMetricFamily(
            "phalanx_job_notice_saved_gpu_seconds",
            "GPU-seconds kept by the workers saving on a notice (eviction, drain, preemption) before they stopped.",
            labels=JOB,
        )
        for (namespace, name), total in list(self._recomputed.items()):
            recomputed.add_metric([namespace, name], total)
        for (namespace, name), total in list(self._saved.items()):
            saved.add_metric([namespace, name], total)
        yield seconds
        yield ratio
        yield recomputed
        yield saved


JOB_TIME = JobTimeCollector()
REGISTRY.register(JOB_TIME)
_PER_JOB = (
    WORKERS_DESIRED,
    WORKERS_READY,
    SPARES_READY,
    GPUS_HELD_BY_SPARES,
    WORLD_SIZE,
    GPUS_REQUESTED,
    GPUS_BOUND,
    RESTART_BUDGET_USED,
    RESTART_BUDGET_LIMIT,
    GOODPUT,
    TRAINING_STEP,
    TRAINING_PERCENT,
    TRAINING_ETA,
)


@dataclass
class _Seen:
    phase: str | None
    restarts: dict[str, int]


_seen: dict[tuple[str, str], _Seen] = {}
_jobs_by_phase: collections.Counter[str | None] = collections.Counter()  # kept with _seen, never recounted
for _phase in PHASES:  # every phase is exported, 0 until a job is in it
    JOBS.labels(_phase).set(0)
_relists: dict[tuple[str, str | None], int] = {}
_synced: dict[tuple[str, str | None], bool] = {}


def observe_informer(resource: str, namespace: str | None, relists: int, synced: bool) -> None:
    """Export an informer's relists and whether every informer of its resource is synced."""
    scope = (resource, namespace)
    WATCH_RELISTS.labels(resource).inc(max(0, relists - _relists.get(scope, 0)))
    _relists[scope] = relists
    _synced[scope] = synced
    WATCH_SYNCED.labels(resource).set(1.0 if all(v for (r, _), v in _synced.items() if r == resource) else 0.0)


def observe_scope(namespace: str | None, synced: bool) -> None:
    """Export whether the jobs of a watched namespace can be reconciled (their watches are synced)."""
    WATCH_SCOPE_SYNCED.labels(namespace or "cluster").set(1.0 if synced else 0.0)


@dataclass(frozen=True)
class JobSample:
    """What one reconcile pass learned about a job, for export."""

    status: Mapping[str, Any]
    previous_status: Mapping[str, Any]
    created: str | None
    gpus_per_worker: int
    bound_workers: int
    rescaled: str | None
    now: datetime
    max_restarts: int | None = None  # failurePolicy.maxRestarts; the limit gauge is exported when given
    bound_spares: int = 0


def goodput(status: Mapping[str, Any], created: str | None, now: datetime) -> float:
    """Training time over wall time since creation, from status alone."""
    start = parse_time(created)
    if start is None or now <= start:
        return 0.0
    trained = float(status.get("trainingSeconds", 0))
    if status.get("phase") in TRAINING:
        running = next((c for c in status.get("conditions", []) if c.get("type") == "Running"), None)
        since = parse_time(running.get("lastTransitionTime")) if running else None
        if since is not None:
            trained += max(0.0, (now - since).total_seconds())
    return min(1.0, trained / (now - start).total_seconds())


def observe_job(key: tuple[str, str], sample: JobSample) -> None:
    """Export one job's state after a reconcile pass."""
    status = sample.status
    if not status:
        return
    namespace, name = key
    phase = status.get("phase")
    for candidate in PHASES:
        JOB_PHASE.labels(namespace, name, candidate).set(1.0 if candidate == phase else 0.0)
    workers = status.get("workers") or {}
    ready = workers.get("ready", 0)
    WORKERS_DESIRED.labels(namespace, name).set(workers.get("desired", 0))
    WORKERS_READY.labels(namespace, name).set(ready)
    WORLD_SIZE.labels(namespace, name).set(ready if phase in TRAINING else 0)
    GPUS_REQUESTED.labels(namespace, name).set(workers.get("desired", 0) * sample.gpus_per_worker)
    GPUS_BOUND.labels(namespace, name).set(sample.bound_workers * sample.gpus_per_worker)
    SPARES_READY.labels(namespace, name).set(workers.get("spares") or 0)
    GPUS_HELD_BY_SPARES.labels(namespace, name).set(sample.bound_spares * sample.gpus_per_worker)
    RESTART_BUDGET_USED.labels(namespace, name).set(status.get("restarts", 0))
    if sample.max_restarts is not None:
        RESTART_BUDGET_LIMIT.labels(namespace, name).set(sample.max_restarts)
    GOODPUT.labels(namespace, name).set(goodput(status, sample.created, sample.now))
    JOB_TIME.observe(key, {**sample.previous_status, **status})
    observe_training_progress(key, status.get("progress", sample.previous_status.get("progress")))
    if sample.rescaled:
        RESCALES.labels(namespace, name, sample.rescaled).inc()
    started = parse_time(status.get("startTime"))
    previous = sample.previous_status
    # startTime is cleared on resume and on Kueue's re-queueing (the deadline's clock restarts): a
    # job that trained before was sampled at its first start
    if started is not None and not previous.get("startTime") and not previous.get("trainingSeconds"):
        created = parse_time(sample.created)
        if created is not None:
            STARTUP.labels(namespace).observe(max(0.0, (started - created).total_seconds()))
    by_reason = dict(status.get("restartsByReason") or {})
    seen = _seen.get(key)
    if seen is not None:  # a process restart starts counting afresh, as Prometheus counters do
        for reason, count in by_reason.items():
            if count > seen.restarts.get(reason, 0):
                RESTARTS.labels(namespace, name, reason).inc(count - seen.restarts.get(reason, 0))
    _seen[key] = _Seen(phase, by_reason)
    if seen is None or seen.phase != phase:
        _move_job(seen.phase if seen is not None else None, phase, new=seen is None)


def observe_training_progress(key: tuple[str, str], progress: Mapping[str, Any] | None) -> None:
    """Export what status.progress says; a value it lacks (no total, no ETA) is no series, not 0."""
    values = progress or {}
    for gauge, field in ((TRAINING_STEP, "step"), (TRAINING_PERCENT, "percent"), (TRAINING_ETA, "etaSeconds")):
        value = values.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            gauge.labels(*key).set(value)
        else:
            with contextlib.suppress(KeyError):
                gauge.remove(*key)


def _move_job(before: str | None, after: str | None, *, new: bool = False, gone: bool = False) -> None:
    """One job changed phase (or came, or went): adjust the two phase totals it touches."""
    if not new:
        _jobs_by_phase[before] -= 1
    if not gone:
        _jobs_by_phase[after] += 1
    for phase in {before, after}:
        if phase in PHASES:
            JOBS.labels(phase).set(_jobs_by_phase[phase])


def forget_job(key: tuple[str, str]) -> None:
    """Drop the series of a deleted job."""
    namespace, name = key
    seen = _seen.pop(key, None)
    JOB_TIME.forget(key)
    for phase in PHASES:
        with contextlib.suppress(KeyError):
            JOB_PHASE.remove(namespace, name, phase)
    for gauge in _PER_JOB:
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
    for reason in seen.restarts if seen else {}:
        with contextlib.suppress(KeyError):
            RESTARTS.remove(namespace, name, reason)
    for direction in ("up", "down"):
        with contextlib.suppress(KeyError):
            RESCALES.remove(namespace, name, direction)
    for target in PROGRESS_TARGETS:
        with contextlib.suppress(KeyError):
            PROGRESS_SCRAPE_FAILURES.remove(namespace, name, target)
    if seen is not None:
        _move_job(seen.phase, None, gone=True)
