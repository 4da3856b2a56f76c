"""Carry out a Plan against the API server, feeding every response back into the caches.

The writes go in this order, which matters for crash safety:

1. status, when it changed or the plan promotes a spare (it records a new attempt, a slot claim,
   the UIDs of the failures it counts and of the workers it deletes itself, before anything else
   happens); a write that only reports progress may be held back for a moment (``StatusPacer``),
   and the rest of the plan goes on without it; a refused write (the job changed since the plan
   was made, or is gone) ends the execution here;
2. the gang's PodGroup, before any pod (a scheduler that sees a pod first may place it alone);
3. every other child in parallel (bounded by the client's cap): Services, the store, worker pods
   and spares, the ranks' EndpointSlices, a NetworkPolicy, a ResourceClaimTemplate (the planner
   creates the pods that need it in a later pass); created when missing, server-side applied when
   they drifted (a pod never: pods are not changed in place);
4. pod patches (``reconcile.pod_patches``), in parallel: the pods an in-place gang restart keeps
   moved to the new attempt and spares promoted into slots; then, once the objects exist (the rank
   names resolve), rank addresses given to the workers;
5. deletions, in parallel: pods and the children no worker needs any more;
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
not installed) are recorded for the planner, which paces retries and explains them in status;
refusals that no retry can fix (validation, Pod Security, a webhook) fail the job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.cluster.cache import ChildCache, JobCache, JobKey, controller_of
from phalanx.cluster.client import ApiClient, ApiError
from phalanx.cluster.events import EventRecorder
from phalanx.reconcile.actions import Deletion
from phalanx.reconcile.observed import ChildKey, Refusal, child_kind
from phalanx.reconcile.plan import Plan, progress_only, status_changed
from phalanx.reconcile.pod_patches import PodPatch

logger = logging.getLogger(__name__)

PROGRESS_WRITE_SECONDS = 5.0  # PHALANX_STATUS_PROGRESS_SECONDS
STARTUP_PROGRESS_WRITE_SECONDS = 15.0
BUSY_PROGRESS_WRITE_SECONDS = 30.0
STARTING_PHASES = ("Pending", "Starting")
RBAC_REFUSAL = re.compile(r'is forbidden: User "[^"]*" cannot ')
# The same plugin before its discovery knows the owner's kind (an API server restarted a moment ago,
# a CRD just installed): it cannot map TrainingJob to a resource, and says so as a 403.
OWNER_KIND_UNKNOWN = "cannot find RESTMapping for APIVersion"
# The OwnerReferencesPermissionEnforcement admission plugin (kube-apiserver's
# plugin/pkg/admission/gc, on in OpenShift): what it refuses, and the permission that is missing.
OWNER_REFERENCE_REFUSALS = (
    (
        "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on",
        "update on trainingjobs/finalizers (phalanx.dev)",
    ),
    ("cannot set an ownerRef on a resource you can't delete", "delete on the child's resource"),
)


class AdmissionRefusedError(Exception):
    """The API server refused to create a child for a reason no retry can fix."""

    def __init__(self, name: str, error: ApiError) -> None:
        super().__init__(f"creating {name} was refused: {error.message}")
        self.name = name
        self.error = error


class StaleStatusError(Exception):
    """The job changed since the plan was made (409 on the status write): plan again."""


def _missing_owner_permission(error: ApiError) -> str | None:
    """The permission whose absence OwnerReferencesPermissionEnforcement reports, if it does."""
    if error.status != 403:
        return None
    return next((missing for words, missing in OWNER_REFERENCE_REFUSALS if words in error.message), None)


RANK_ADDRESSES_REFUSED = "RankAddressesRefused"


def passing_refusal(kind: str, error: ApiError) -> str | None:
    """The reason of a creation refusal that may pass on its own, or None if it is permanent.
    Missing permissions may pass (an administrator grants them), whether RBAC refused the request
    or an admission plugin that checks RBAC for owner references did, and so does that plugin's
    not knowing the owner's kind yet. The ranks' EndpointSlices never fail a job, whatever refused
    them (an address the API server does not take, a policy): rank addresses only order the ranks,
    and each worker falls back to its pod IP (docs/placement.md); status says why they are missing."""
    if kind == "EndpointSlice" and error.status in (400, 403, 422):
        return RANK_ADDRESSES_REFUSED
    if error.status == 403 and "exceeded quota" in error.message:
        return "QuotaExceeded"
    if error.status == 403 and (RBAC_REFUSAL.search(error.message) or _missing_owner_permission(error)):
        return "OperatorForbidden"
    if error.status == 403 and OWNER_KIND_UNKNOWN in error.message:
        return "OwnerKindNotDiscovered"
    if error.status == 404:
        return "GangSchedulerUnavailable" if kind == "PodGroup" else "NotFound"
    if error.status in (422, 403, 400):
        return None
    return "Refused"


def refusal_message(error: ApiError) -> str:
    """What status says of a passing refusal: the API server's words, and for an owner-reference
    refusal the permission to grant (the API server names none)."""
    missing = _missing_owner_permission(error)
    if missing is None:
        return error.message
    return (
        f"{error.message} (the operator lacks {missing}, which the OwnerReferencesPermissionEnforcement "
        "admission plugin requires to set the owner reference; the chart's RBAC rules grant it)"
    )


class RefusalMemory:
    """What the API server last refused to create, by job UID and child (kind and name: the store's
    Service and pod share a name, and creating one must not clear the other's refusal), for the
    planner; and, per job, how many creations passed since its last refusal: the slow start of its
    retries (``batch``)."""

    def __init__(self) -> None:
        self._refusals: dict[str, dict[ChildKey, Refusal]] = {}
        self._jobs: dict[str, tuple[str, str]] = {}
        self._passed: dict[str, int] = {}  # job UID -> creations that passed since its last refusal

    def record(
        self, job_uid: str, key: tuple[str, str], child: ChildKey, reason: str, message: str, now: datetime
    ) -> None:
        known = self._refusals.setdefault(job_uid, {}).get(child)
        self._jobs[job_uid] = key
        self._passed[job_uid] = 0
        if known is not None and known.reason == reason:
            # after a freed quota the pauses start short again: the quota controller may lag
            attempts = 1 if known.retry_now else known.attempts + 1
            refusal = Refusal(reason, message, known.first, now, attempts)
        else:
            refusal = Refusal(reason, message, now, now)
        self._refusals[job_uid][child] = refusal

    def clear(self, job_uid: str, child: ChildKey) -> None:
        """A creation passed (or found its object)."""
        refusals = self._refusals.get(job_uid)
        if refusals is None:
            return
        refusals.pop(child, None)
        self._passed[job_uid] = self._passed.get(job_uid, 0) + 1
        if not refusals:
            self._refusals.pop(job_uid, None)
            self._jobs.pop(job_uid, None)
            self._passed.pop(job_uid, None)

    def of(self, job_uid: str) -> dict[ChildKey, Refusal]:
        return dict(self._refusals.get(job_uid, {}))

    def batch(self, job_uid: str) -> int:
        """How many pods the job's next pass may create while some are refused: one probe after a
        refusal, then twice as many each time they pass (1, 2, 4, ...: the Job controller's slow
        start), so a blocked job costs one request per retry, not one per pod."""
        return self._passed.get(job_uid, 0) + 1

    def forget_job(self, key: tuple[str, str]) -> None:
        for job_uid in [uid for uid, known in self._jobs.items() if known == key]:
            self._refusals.pop(job_uid, None)
            self._jobs.pop(job_uid, None)
            self._passed.pop(job_uid, None)

    def quota_freed(self, namespace: str) -> list[tuple[str, str]]:
        """A pod in ``namespace`` went away: jobs refused by a quota there may try their probe without
        waiting out a long pause (the planner still keeps the first pause between two probes, so a
        namespace's churn cannot make a job hammer). Returns the jobs to wake, once each."""
        woken = []
        for job_uid, refusals in self._refusals.items():
            key = self._jobs[job_uid]
            if key[0] != namespace:
                continue
            waiting = False
            for name, refusal in list(refusals.items()):
                if refusal.reason == "QuotaExceeded" and not refusal.retry_now:
                    refusals[name] = dataclasses.replace(refusal, retry_now=True)
                    waiting = True
            if waiting:
                woken.append(key)
        return woken


class StatusPacer:
    """When each job's status was last written: a write that only reports progress (plan.progress_only)
    goes out at most once per ``interval`` and carries what changed meanwhile, so a gang of pods
    starting one by one costs one write, not one per pod. A job starting up (Pending, Starting)
    reports its counts at most every ``startup_interval``: its phase says what happens, and the
    next phase comes soon. While the operator is ``busy`` (jobs wait in its queue), progress waits
    up to ``busy_interval``: the requests go to creating what jobs need. Decisions are never held
    back."""

    def __init__(
        self,
        interval: float = PROGRESS_WRITE_SECONDS,
        *,
        startup_interval: float = STARTUP_PROGRESS_WRITE_SECONDS,
        busy_interval: float = BUSY_PROGRESS_WRITE_SECONDS,
        busy: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.startup_interval = startup_interval
        self.busy_interval = busy_interval
        self.busy = busy
        self._clock = clock
        self._written: dict[JobKey, float] = {}

    def hold(self, key: JobKey, *, starting: bool = False) -> float:
        """Seconds a progress-only write of this job should still wait (0: write now)."""
        written = self._written.get(key)
        if written is None:
            return 0.0
        interval = max(self.interval, self.startup_interval) if starting else self.interval
        if self.busy():
            interval = max(interval, self.busy_interval)
        return max(0.0, written + interval - self._clock())

    def wrote(self, key: JobKey) -> None:
        self._written[key] = self._clock()

    def forget(self, key: JobKey) -> None:
        self._written.pop(key, None)


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
    if plan.status and (plan.promotes or status_changed(job.get("status"), plan.status)):
        starting = plan.status.get("phase") in STARTING_PHASES
        hold = (
            run.pacer.hold((namespace, name), starting=starting)
            if progress_only(job.get("status"), plan.status) and not plan.promotes
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

    async def put(obj: Mapping[str, Any]) -> None:
        ident = (child_kind(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"])
        record = known.get(ident)
        if obj["kind"] != "Pod" and record is not None and record.uid:
            await _update(run, job, obj, record.uid, now)
        elif obj["kind"] != "Pod" or ident[1] not in pods:
            await _create(run, job, obj, now)

    # The gang's PodGroup before any pod (a scheduler that sees a pod first may place it alone);
    # then the Service, the store and the workers together.
    groups = [obj for obj in plan.apply if obj["kind"] == "PodGroup"]
    for obj in groups:
        await put(obj)
    await asyncio.gather(*(put(obj) for obj in plan.apply if obj["kind"] != "PodGroup"))

    async def patch(pod: PodPatch) -> None:
        response = await run.client.patch_if("v1", "Pod", namespace, pod.name, pod.body())
        if response is not None:
            run.children.observe("MODIFIED", response)

    await asyncio.gather(*(patch(pod) for pod in plan.move))
    # after the objects: the rank names resolve (the EndpointSlices) before a supervisor reads them
    await asyncio.gather(*(patch(pod) for pod in plan.address))

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

    await asyncio.gather(*(remove(deletion) for deletion in plan.delete))
    for event in plan.events:
        run.events.record(job, event, now)
    if plan.delete_job:
        await run.client.delete(api.API_VERSION, api.KIND, namespace, name, plural=api.PLURAL, uid=uid)
        run.jobs.deleted((namespace, name), uid)
    return held
