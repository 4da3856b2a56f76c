"""Prometheus metrics of the operator process.

Reconcile-loop metrics reuse controller-runtime's names so stock controller dashboards
work. Per-job series are labelled by namespace and job name only (never pods or UIDs),
and are removed when the job is deleted, so cardinality stays bounded by live jobs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

RECONCILE_TOTAL = Counter("controller_runtime_reconcile_total", "Reconcile passes by result.", ["controller", "result"])
RECONCILE_ERRORS = Counter("controller_runtime_reconcile_errors_total", "Reconcile passes that raised.", ["controller"])
RECONCILE_TIME = Histogram(
    "controller_runtime_reconcile_time_seconds",
    "Duration of one reconcile pass.",
    ["controller"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

PHASES = ("Pending", "Starting", "Running", "Rescaling", "Restarting", "Succeeded", "Failed", "Suspended")
JOB_PHASE = Gauge(
    "phalanx_job_phase", "1 for the job's current phase, 0 for the others.", ["namespace", "name", "phase"]
)
WORKERS_DESIRED = Gauge("phalanx_job_workers_desired", "Workers the job aims for.", ["namespace", "name"])
WORKERS_READY = Gauge("phalanx_job_workers_ready", "Ready workers of the current attempt.", ["namespace", "name"])
JOB_RESTARTS = Gauge("phalanx_job_restarts", "Counted restarts (the restart budget used).", ["namespace", "name"])

_PER_JOB = (WORKERS_DESIRED, WORKERS_READY, JOB_RESTARTS)


def observe_job(key: tuple[str, str], status: Mapping[str, Any]) -> None:
    """Export one job's status."""
    if not status:
        return
    namespace, name = key
    phase = status.get("phase")
    for candidate in PHASES:
        JOB_PHASE.labels(namespace, name, candidate).set(1.0 if candidate == phase else 0.0)
    workers = status.get("workers") or {}
    WORKERS_DESIRED.labels(namespace, name).set(workers.get("desired", 0))
    WORKERS_READY.labels(namespace, name).set(workers.get("ready", 0))
    JOB_RESTARTS.labels(namespace, name).set(status.get("restarts", 0))


def forget_job(key: tuple[str, str]) -> None:
    """Drop the series of a deleted job."""
    namespace, name = key
    for phase in PHASES:
        with contextlib.suppress(KeyError):
            JOB_PHASE.remove(namespace, name, phase)
    for gauge in _PER_JOB:
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
