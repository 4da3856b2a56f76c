"""TrainingJob handlers: watch events name the job, one reconcile pass does the work.

The pass is the whole operator in five lines: parse -> observe -> plan -> apply -> status.
We use ``kopf.on.event`` rather than create/update handlers: event handlers keep no
progress or diff-base annotations, so kopf never writes to the user's object, and no
finalizer blocks deletion when the operator is down (children go with their owner
references).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import kopf
import pydantic

from phalanx import metrics
from phalanx.api import v1alpha1 as api
from phalanx.cluster.apply import AdmissionRefusedError, execute
from phalanx.cluster.cache import JobKey
from phalanx.handlers.runtime import Runtime
from phalanx.reconcile import plan as planner

logger = logging.getLogger(__name__)


def _validation_message(error: pydantic.ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}"


async def reconcile(runtime: Runtime, key: JobKey) -> float | None:
    """One pass over one TrainingJob; returns seconds until it wants another pass."""
    body = runtime.jobs.get(key)
    if body is None:
        return None
    started = time.perf_counter()
    now = datetime.now(UTC)
    result = "success"
    try:
        try:
            job = api.TrainingJob.from_body(body)
        except pydantic.ValidationError as error:
            message = _validation_message(error)
            status = planner.invalid_status(body.get("status"), body["metadata"].get("generation", 0), message, now)
            if planner.status_changed(body.get("status"), status):
                updated = await runtime.client.patch_status(api.API_VERSION, api.PLURAL, key[0], key[1], status)
                runtime.jobs.update(updated)
            return None
        progress = runtime.progress.get(key) if runtime.progress is not None else None
        observed = runtime.children.observed(key, runtime.nodes.unready(), progress)
        plan = planner.plan(job, observed, now)
        try:
            await execute(plan, client=runtime.client, job=body, jobs=runtime.jobs, children=runtime.children, now=now)
        except AdmissionRefusedError as refused:
            failed = planner.fail(job, observed, now, "PodRefused", str(refused))
            await execute(
                failed,
                client=runtime.client,
                job=runtime.jobs.get(key) or body,
                jobs=runtime.jobs,
                children=runtime.children,
                now=now,
            )
            return None
        if plan.changes_children:
            result = "requeue"
        bound = sum(
            1
            for pod in observed.workers()
            if pod.active and pod.scheduled and pod.attempt == plan.status.get("attempt")
        )
        metrics.observe_job(
            key,
            metrics.JobSample(
                status=plan.status,
                previous_status=body.get("status") or {},
                created=job.metadata.creation_timestamp,
                gpus_per_worker=job.spec.gpus.count,
                bound_workers=bound,
                rescaled=plan.rescaled,
                now=now,
            ),
        )
        return plan.requeue_after
    except Exception:
        result = "error"
        metrics.RECONCILE_ERRORS.labels(controller="trainingjob").inc()
        raise
    finally:
        metrics.RECONCILE_TOTAL.labels(controller="trainingjob", result=result).inc()
        metrics.RECONCILE_TIME.labels(controller="trainingjob").observe(time.perf_counter() - started)


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, id="trainingjob-events")
async def trainingjob_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Remember the latest body and ask for a pass; forget jobs that are gone."""
    runtime: Runtime = memo.runtime
    body = event["object"]
    if event["type"] == "DELETED":
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        runtime.jobs.forget(key)
        runtime.children.forget(key)
        runtime.queue.forget(key)
        if runtime.progress is not None:
            runtime.progress.forget(key)
        metrics.forget_job(key)
        return
    runtime.queue.enqueue(runtime.jobs.update(body))
