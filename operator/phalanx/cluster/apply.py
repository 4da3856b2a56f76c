"""Carry out a Plan against the API server, feeding every response back into the caches.

The writes go in this order, which matters for crash safety:

1. status, when it changed or the plan promotes a spare (it records a new attempt, a slot claim,
   the UIDs of the failures it counts and of the workers it deletes itself, before anything else
   happens); a write that only reports progress may be held back for a moment (``status_pacing``),
   and the rest of the plan goes on without it; a refused write (the job changed since the plan
   was made, or is gone) ends the execution here;
2. the children stage by stage as ``child_kinds`` orders them: the gang's PodGroup before any pod
   (a scheduler that sees a pod first may place it alone);
3. then every other child in parallel (bounded by the client's cap): Services, the store, worker pods
   and spares, the ranks' EndpointSlices, a NetworkPolicy, a ResourceClaimTemplate (the planner
   creates the pods that need it in a later pass); created when missing, server-side applied when
   they drifted (a pod never: pods are not changed in place);
   then the Kueue Workload's priority boost (``reconcile.preemption_cost``), a JSON patch that
   tests the Workload's UID and the annotation's old value, never held back by pacing;
4. pod deletions, in parallel: a pod leaving a slot goes before a spare is promoted into it, so
   two pods never hold one slot, not for the latency of a request nor until the next pass after a
   SIGKILL between the two (the status write already claimed the slot for the spare);
5. pod patches (``reconcile.pod_patches``), in parallel: the pods an in-place gang restart keeps
   moved to the new attempt and spares promoted into slots; then, once the objects exist (the rank
   names resolve), rank addresses given to the workers, and a save-now token carried onto running
   workers (``reconcile.save_now``; the status write before it recorded the token); then the
   other deletions, in parallel: the children no worker needs any more;
6. Events handed to the ``EventRecorder``, which posts them after the requests that create and
   fix things;
7. the TrainingJob itself, deleted when its ``ttlSecondsAfterFinished`` has passed.

A SIGKILL between any two requests leaves a state the next pass completes without counting or
creating anything twice:

- the status write is conditional on the resourceVersion the plan was made from, so a status
  computed from a stale view is refused (409) instead of overwriting a newer one;
- children are created by POST, which never touches an existing object (``ApiClient.create``): a
  name held by an object this job does not control is left alone and reported, and a create that
  finds our own object (the response was lost, or the cache was behind) just takes it into the cache;
- drifted children other than pods are server-side applied with their UID as a precondition;
- pods, and EndpointSlices no worker needs any more, are deleted with their UID as a precondition,
  so only the object that was planned goes;
- every pod patch is a JSON patch whose tests name the pod (its UID) and its state (its attempt,
  a spare's role), so a repeated patch, or one planned from a view the pod has left, changes
  nothing (``ApiClient.patch_if``);
- a spare is promoted only after the status write that records its slot claim passed the
  resourceVersion precondition (written even when nothing else changed: ``Plan.promotes``), so
  two passes planned from one version of the job never both promote into a slot (``slots``).

Refusals that may pass (quota, a name conflict, missing permission, a gang scheduler API that is
not installed) are recorded for the planner (``refusals``), which paces retries and explains them in status;
refusals that no retry can fix (validation, Pod Security, a webhook) fail the job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.cluster.cache import ChildCache, JobCache, controller_of
from phalanx.cluster.client import ApiClient, ApiError
from phalanx.cluster.events import EventRecorder
from phalanx.cluster.refusals import RANK_ADDRESSES_REFUSED, RefusalMemory, passing_refusal, refusal_message
from phalanx.cluster.status_pacing import STARTING_PHASES, StatusPacer
from phalanx.reconcile import child_kinds
from phalanx.reconcile.actions import Deletion
from phalanx.reconcile.observed import child_kind
from phalanx.reconcile.plan import Plan, progress_only, status_changed
from phalanx.reconcile.pod_patches import PodPatch

logger = logging.getLogger(__name__)


class AdmissionRefusedError(Exception):
    """The API server refused to create a child for a reason no retry can fix."""

    def __init__(self, name: str, error: ApiError) -> None:
        super().__init__(f"creating {name} was refused: {error.message}")
        self.name = name
        self.error = error


class StaleStatusError(Exception):
    """The job changed since the plan was made (409 on the status write): plan again."""


@dataclass
class Execution:
    """Everything one execution needs besides the plan."""

    client: ApiClient
    jobs: JobCache
    children: ChildCache
    refusals: RefusalMemory
    events: EventRecorder
    pacer: StatusPacer = dataclasses.field(default_factory=StatusPacer)


async def _create(run: Execution, job: Mapping[str, Any], obj: Mapping[str, Any], now: datetime) -> None:
    metadata = job["metadata"]
    kind, name = obj["kind"], obj["metadata"]["name"]
    child = (child_kind(obj["apiVersion"], kind), name)
    try:
        response = await run.client.create(obj)
    except ApiError as error:
        if error.status == 409:
            await _name_taken(run, job, obj, now)
            return
        reason = passing_refusal(kind, error)
        if reason is None:
            raise AdmissionRefusedError(f"{kind} {name}", error) from error
        logger.info("creating %s %s/%s refused (%s): %s", kind, metadata["namespace"], name, reason, error.message)
        run.refusals.record(
            metadata["uid"],
            (metadata["namespace"], metadata["name"]),
            child,
            reason,
            refusal_message(error),
            now,
        )
        return
    run.refusals.clear(metadata["uid"], child)
    run.children.observe("ADDED", response)


async def _name_taken(run: Execution, job: Mapping[str, Any], obj: Mapping[str, Any], now: datetime) -> None:
    """409 on create: ours (a lost response, a cache behind the server) or someone else's."""
    metadata = job["metadata"]
    kind, name = obj["kind"], obj["metadata"]["name"]
    child = (child_kind(obj["apiVersion"], kind), name)
    try:
        existing = await run.client.get(obj["apiVersion"], kind, metadata["namespace"], name)
    except ApiError as error:
        if error.status == 404:
            return  # gone again since: the next pass creates it
        raise
    owner = controller_of(existing)
    if owner is not None and owner[1] == metadata["uid"]:
        run.refusals.clear(metadata["uid"], child)
        run.children.observe("ADDED", existing)
        return
    holder = f"TrainingJob {owner[0]} (uid {owner[1]})" if owner is not None else "no TrainingJob"
    message = f"{kind} {name} already exists, controlled by {holder}; phalanx leaves it alone"
    job_key = (metadata["namespace"], metadata["name"])
    run.refusals.record(metadata["uid"], job_key, child, "NameConflict", message, now)


async def _update(run: Execution, job: Mapping[str, Any], obj: Mapping[str, Any], uid: str, now: datetime) -> None:
    try:
        response = await run.client.apply(obj, uid=uid)
    except ApiError as error:
        if error.status in (404, 409) or (error.status == 422 and "metadata.uid" in error.message):
            return  # replaced or gone since we looked: the next pass sees it
        if obj["kind"] == "EndpointSlice" and passing_refusal(obj["kind"], error) is not None:
            # never aborts the pass (failures, moves and deletions come after it): said in status
            metadata, name = job["metadata"], obj["metadata"]["name"]
            child = (child_kind(obj["apiVersion"], obj["kind"]), name)
            run.refusals.record(
                metadata["uid"],
                (metadata["namespace"], metadata["name"]),
                child,
                RANK_ADDRESSES_REFUSED,
                refusal_message(error),
                now,
            )
            return
        raise
    child = (child_kind(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"])
    if child in run.refusals.of(job["metadata"]["uid"]):
        run.refusals.clear(job["metadata"]["uid"], child)
    run.children.observe("MODIFIED", response)


async def write_status(run: Execution, job: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Write status from a plan made on ``job``; False if the job is gone."""
    metadata = job["metadata"]
    try:
        updated = await run.client.patch_status(
            api.API_VERSION,
            api.PLURAL,
            metadata["namespace"],
            metadata["name"],
            status,
            resource_version=metadata.get("resourceVersion"),
        )
    except ApiError as error:
        if error.status == 404:
            return False
        if error.status == 409:
            raise StaleStatusError(f"{metadata['namespace']}/{metadata['name']} changed since it was read") from error
        raise
    run.jobs.answered(updated)
    return True


async def execute(plan: Plan, run: Execution, *, job: Mapping[str, Any], now: datetime) -> float | None:
    """Apply the plan; returns seconds until a status write held back for pacing is due (None: none
    was). Raises AdmissionRefusedError when the API server refuses a child for good."""
    metadata = job["metadata"]
    namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
    held: float | None = None
    # a promotion's slot claim must pass the precondition before its patch: written, never held back
    # so is one that records a Workload boost (its time holds the next change back)
    urgent = plan.promotes or plan.boost is not None
    if plan.status and (urgent or status_changed(job.get("status"), plan.status)):
        starting = plan.status.get("phase") in STARTING_PHASES
        hold = (
            run.pacer.hold((namespace, name), starting=starting)
            if progress_only(job.get("status"), plan.status) and not urgent
            else 0.0
        )
        if hold > 0:
            held = hold
        elif await write_status(run, job, plan.status):
            run.pacer.wrote((namespace, name))
        else:
            return None
    known = run.children.objects_of(namespace, uid)
    pods = {pod.name: pod for pod in run.children.pods_of(namespace, uid)}

    if plan.boost is not None:  # Kueue's Workload, not ours: a guarded patch of one annotation
        try:
            await run.client.patch_if(
                child_kinds.KUEUE_WORKLOAD.api_version, "Workload", namespace, plan.boost.name, plan.boost.body()
            )
        except ApiError as error:  # advisory: a refused boost (RBAC, a webhook) must not stop the job's pass
            logger.warning(
                "%s/%s: Kueue Workload %s kept its priority boost: %s", namespace, name, plan.boost.name, error
            )

    async def put(obj: Mapping[str, Any]) -> None:
        ident = (child_kind(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"])
        record = known.get(ident)
        if obj["kind"] != "Pod" and record is not None and record.uid:
            await _update(run, job, obj, record.uid, now)
        elif obj["kind"] != "Pod" or ident[1] not in pods:
            await _create(run, job, obj, now)

    # Stage by stage (child_kinds: the gang's PodGroup before any pod, since a scheduler that sees
    # a pod first may place it alone), each stage's objects at once.
    stages = sorted({child_kinds.write_stage(obj["apiVersion"], obj["kind"]) for obj in plan.apply})
    for stage in stages:
        await asyncio.gather(
            *(put(obj) for obj in plan.apply if child_kinds.write_stage(obj["apiVersion"], obj["kind"]) == stage)
        )

    async def patch(pod: PodPatch) -> None:
        response = await run.client.patch_if("v1", "Pod", namespace, pod.name, pod.body())
        if response is not None:
            run.children.observe("MODIFIED", response)

    async def remove(deletion: Deletion) -> None:
        if deletion.kind == "Pod":
            pod = pods.get(deletion.name)
            found = pod.uid if pod is not None else None
        else:
            record = known.get((child_kind(deletion.api_version, deletion.kind), deletion.name))
            found = record.uid if record is not None else None
            if not found:
                return  # only an object of this job's, by its UID: one not in the cache may be another's
        await run.client.delete(
            deletion.api_version,
            deletion.kind,
            namespace,
            deletion.name,
            grace_seconds=deletion.grace_seconds,
            uid=found or None,
        )
        if deletion.kind == "Pod" and found is not None:
            run.children.mark_deleting(namespace, uid, deletion.name)

    # pods before the moves (step 4 above): a spare never shares a slot with the pod it replaces
    pod_deletions = [deletion for deletion in plan.delete if deletion.kind == "Pod"]
    await asyncio.gather(*(remove(deletion) for deletion in pod_deletions))
    await asyncio.gather(*(patch(pod) for pod in plan.move))
    # after the objects: the rank names resolve (the EndpointSlices) before a supervisor reads them
    await asyncio.gather(*(patch(pod) for pod in plan.address))
    await asyncio.gather(*(patch(pod) for pod in plan.notices))  # a save-now token, after status took it
    await asyncio.gather(*(remove(deletion) for deletion in plan.delete if deletion.kind != "Pod"))
    for event in plan.events:
        run.events.record(job, event, now)
    if plan.delete_job:
        await run.client.delete(api.API_VERSION, api.KIND, namespace, name, plural=api.PLURAL, uid=uid)
        run.jobs.deleted((namespace, name), uid)
    return held
