"""One reconcile pass over one TrainingJob: parse -> observe -> plan -> apply -> status.

Passes are run by the work queue when an informer reports a change to the job, to one of its
children or to a node its pods are on; the operator writes nothing to the user's object but
its status, and adds no finalizer (children go with their owner references).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import UTC, datetime

import pydantic

from phalanx import metrics
from phalanx.api import v1alpha1 as api
from phalanx.cluster.apply import AdmissionRefusedError, StaleStatusError, execute
from phalanx.cluster.cache import JobKey
from phalanx.cluster.client import ApiError, NotLeadingError
from phalanx.cluster.node_ledger import NodeLedgerStore
from phalanx.handlers.runtime import Runtime
from phalanx.reconcile import node_ledger
from phalanx.reconcile import plan as planner
from phalanx.reconcile.observed import Observed
from phalanx.reconcile.pass_values import Context

logger = logging.getLogger(__name__)


def _validation_message(error: pydantic.ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}"


async def _refresh(runtime: Runtime, key: JobKey) -> None:
    """Read the job again after a status write found it changed."""
    try:
        body = await runtime.client.get(api.API_VERSION, api.KIND, key[0], key[1], plural=api.PLURAL)
    except ApiError as error:
        if error.status == 404:
            return
        raise
    runtime.jobs.answered(body)


async def _with_node_ledger(
    ledger: NodeLedgerStore, job: api.TrainingJob, observed: Observed, now: datetime
) -> Observed:
    """Count what this job's pods say against their nodes in the cluster-wide ledger (once per pod),
    and plan with the nodes it avoids."""
    await ledger.ready()
    await ledger.record(node_ledger.evidence_of(Context(job, observed, now)), now)
    return dataclasses.replace(observed, ledger_avoided=ledger.avoided(now))


async def reconcile(runtime: Runtime, key: JobKey) -> float | None:
    """One pass over one TrainingJob; returns seconds until it wants another pass."""
    if not runtime.synced(key[0]):
        return None  # every job gets a pass the moment the last informer of its namespace is synced
    body = runtime.jobs.get(key)
    if body is None:
        return None
    started = time.perf_counter()
    now = datetime.now(UTC)
    result = "success"
    run = runtime.execution()
    try:
        try:
            job = api.TrainingJob.from_body(body)
        except pydantic.ValidationError as error:
            message = _validation_message(error)
            logger.warning("cannot parse %s/%s: %s; leaving it and its pods alone", key[0], key[1], message)
            await execute(planner.unparsable(body, message, now), run, job=body, now=now)
            return None
        observed = runtime.observe(job)
        if runtime.ledger is not None:
            observed = await _with_node_ledger(runtime.ledger, job, observed, now)
        # tenant-edited values the records left out: said once, by the replica that leads
        for warning in runtime.children.take_ignored_values(job.metadata.namespace, job.metadata.uid):
            run.events.record(body, warning, now)
        plan = planner.plan(job, observed, now)
        try:
            held = await execute(plan, run, job=body, now=now)
        except AdmissionRefusedError as refused:
            failed = planner.fail(job, observed, now, "PodRefused", str(refused))
            await execute(failed, run, job=runtime.jobs.get(key) or body, now=now)
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
                max_restarts=job.spec.failure_policy.max_restarts,
                bound_workers=bound,
                bound_spares=sum(1 for pod in observed.spares() if pod.active and pod.scheduled),
                rescaled=plan.rescaled,
                now=now,
            ),
        )
        if runtime.refusals.of(job.metadata.uid) != dict(observed.refusals):
            return 0.05  # refused just now: the next pass paces the retry and says why in status
        if held is not None:  # a progress-only status write waits; this pass comes back for it
            return held if plan.requeue_after is None else min(held, plan.requeue_after)
        return plan.requeue_after
    except StaleStatusError as stale:
        result = "requeue"
        logger.info("%s; planning again", stale)
        await _refresh(runtime, key)
        return 0.0
    except NotLeadingError:
        result = "fenced"  # the Lease lapsed by our clock: not an error of this job's
        raise
    except Exception:
        result = "error"
        metrics.RECONCILE_ERRORS.labels(controller="trainingjob").inc()
        raise
    finally:
        if runtime.jobs.get(key) is None:  # deleted while this pass ran
            runtime.forget(key)
        metrics.RECONCILE_TOTAL.labels(controller="trainingjob", result=result).inc()
        metrics.RECONCILE_TIME.labels(controller="trainingjob").observe(time.perf_counter() - started)
