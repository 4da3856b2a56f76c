"""The planner: TrainingJob + observed children + now -> changes, events and the next status.

It does no I/O and reads no clock: ``now`` is an argument. Everything the job must
remember between passes (the attempt, the restart budget, the backoff deadline, start
and completion times) lives in ``status``, so the operator can restart at any moment,
and deleting children never resets a budget. Planning against the result of its own
plan yields no change.

Ordering that matters for crash safety: a gang restart is first recorded in status (a
new attempt) and only then are the old pods deleted. A crash in between leaves pods of
an old attempt, which the next pass deletes as stale without counting them again.

Exactly-once counting: every failure recorded in ``restarts``/``restartsByReason`` adds the
failed pod's UID to ``status.countedFailures`` in the same status write. A pod whose UID is
there is never counted again, however often the operator restarts, a delete fails or a late
watch event shows it once more; a UID leaves the record only when the pod is gone from a
synced view, and UIDs are never reused. The workers a pass finds failed are one failure event,
counted once whether they are replaced one by one or the gang restarts: correlated failures
(an OOM at the same step, an NCCL cascade) are one incident, and the count must not depend on
how many workers survive it.

Nodes: a pod is taken for lost with its node only when the node was deleted or has not been
Ready for the operator's grace (``NodeLoss``); a pod the taint manager evicts says so itself.
A pod whose container may still run is never force-deleted unless its node object is gone or the
operator was told to.

Creations the API server refused for a reason that may pass (a quota, a name held by an
object this job does not own, a gang scheduler API that is not installed) never fail the
job: the pass leaves that child out, retries at a paced interval, and says why in the
``Stalled`` condition and an Event. Pods are retried with a slow start, as the Job controller
does: one probe when the job's last refusal's pause has passed, then twice as many each time
creations pass (``Observed.retry_batch``), so a blocked job of hundreds of workers costs one
request per pause, not hundreds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import capacity, desired, naming
from phalanx.reconcile.environment import Launch, resolve_launch
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.failures import Failure, classify
from phalanx.reconcile.observed import Observed, PodRecord, Refusal, child_kind
from phalanx.reconcile.status import PhaseView, conditions, format_time, parse_time

Object = dict[str, Any]
TERMINAL = ("Succeeded", "Failed")
TRAINING = ("Running", "Rescaling")
SUCCESS_GRACE_SECONDS = 60
REFUSAL_RETRY_SECONDS = (2.0, 5.0, 10.0, 30.0, 60.0)
"""Pause before creating a refused child again, by how many times in a row it was refused."""
NODE_CAPACITY_STAMP_SECONDS = 10.0
"""Least time between two new node-capacity stamps on one waiting PodGroup: pods leave the cluster
all the time, and each would otherwise cost every waiting gang a PodGroup write."""


def refusal_retry_at(refusal: Refusal) -> datetime:
    """When a refused creation is tried again."""
    pause = REFUSAL_RETRY_SECONDS[min(refusal.attempts, len(REFUSAL_RETRY_SECONDS)) - 1]
    return refusal.last + timedelta(seconds=pause)


@dataclass(frozen=True)
class Deletion:
    """A child to delete; ``grace_seconds=0`` force-deletes a pod that has finished or that no
    kubelet can stop any more (see ``_Pass.remove``)."""

    kind: str
    name: str
    grace_seconds: int | None = None


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to record on the TrainingJob."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Plan:
    """What one reconcile pass should do."""

    apply: tuple[Object, ...] = ()
    delete: tuple[Deletion, ...] = ()
    status: dict[str, Any] = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None
    delete_job: bool = False
    rescaled: Literal["up", "down"] | None = None

    @property
    def changes_children(self) -> bool:
        """Whether the plan creates, changes or deletes anything besides status."""
        return bool(self.apply or self.delete or self.delete_job)


@dataclass
class _Memory:
    """The part of status that carries over between passes."""

    attempt: int
    restarts: int
    by_reason: dict[str, int]
    counted: set[str]
    start_time: str | None
    completion_time: str | None
    restart_not_before: str | None

    @classmethod
    def of(cls, status: api.TrainingJobStatus) -> _Memory:
        return cls(
            attempt=status.attempt,
            restarts=status.restarts,
            by_reason=dict(status.restarts_by_reason or {}),
            counted=set(status.counted_failures or ()),
            start_time=status.start_time,
            completion_time=status.completion_time,
            restart_not_before=status.restart_not_before,
        )


def worker_event_reason(reason: str) -> str:
    """The reason of the event for one replaced worker: Worker<Reason>, without doubling the prefix
    (WorkerFailed, not WorkerWorkerFailed)."""
    return reason if reason.startswith("Worker") else f"Worker{reason}"


def failure_event(failures: list[tuple[PodRecord, Failure]]) -> Failure:
    """The one failure event the workers failed in one pass make: its first counted failure, else
    its first (``restartsByReason`` gets one entry per event, not per pod)."""
    counted = [failure for _, failure in failures if failure.counted]
    return counted[0] if counted else failures[0][1]


def backoff_seconds(policy: api.FailurePolicy, counted_restarts: int) -> int:
    """Exponential backoff: backoffSeconds doubled per counted restart, capped."""
    if counted_restarts <= 0:
        return 0
    return int(min(policy.max_backoff_seconds, policy.backoff_seconds * 2 ** (counted_restarts - 1)))


class _Pass:
    """One planning pass; accumulates changes, then renders a Plan."""

    def __init__(self, job: api.TrainingJob, observed: Observed, now: datetime) -> None:
        self.job = job
        self.spec = job.spec
        self.observed = observed
        self.now = now
        self.memory = _Memory.of(job.status)
        self.apply: list[Object] = []
        self.delete: list[Deletion] = []
        self.events: list[Event] = []
        self.requeue: list[float] = []
        self.delete_job = False
        self.rescaled: Literal["up", "down"] | None = None
        self.stalled: tuple[str, str] | None = None
        self.blocked: list[tuple[str, str]] = []  # (reason, message) of children we could not create
        self.pod_budget: int | None = None  # pods this pass may still create (None: no limit)
        self.pod_budget_known = False

    # -- helpers ---------------------------------------------------------------------------------

    def node_lost(self, pod: PodRecord) -> str | None:
        """Why the pod's node is taken for lost, or None: it was deleted, or it has not been Ready
        for the whole grace. A shorter blip changes nothing (``watch_nodes``)."""
        node, loss = pod.node_name, self.observed.node_loss
        if node is None:
            return None
        if node in loss.deleted:
            return "was deleted"
        if node not in self.observed.unready_nodes:
            return None
        unready = (self.now - loss.unready_since.get(node, self.now)).total_seconds()
        if unready < loss.grace_seconds:
            return None
        return f"has not been ready for {int(unready)}s (node-lost grace {int(loss.grace_seconds)}s)"

    def watch_nodes(self) -> None:
        """Force-delete terminating pods no kubelet can confirm any more (``may_force_delete``), and
        come back when the grace of a not-ready node that holds an active pod of the job runs out."""
        loss = self.observed.node_loss
        for pod in self.observed.pods:
            node = pod.node_name
            if pod.deleting and self.may_force_delete(pod):
                self.remove(pod)
            if pod.active and node in self.observed.unready_nodes and node not in loss.deleted:
                since = loss.unready_since.get(node, self.now)
                remaining = (since + timedelta(seconds=loss.grace_seconds) - self.now).total_seconds()
                if remaining > 0:
                    self.requeue.append(remaining)

    def may_force_delete(self, pod: PodRecord) -> bool:
        """Whether no container of the pod can run any more, or the operator may act as if: its node
        object is gone, or the node is lost and the operator was told to force (otherwise two agents
        could train in one slot and both write checkpoints)."""
        loss = self.observed.node_loss
        return pod.node_name in loss.deleted or (loss.force_delete and self.node_lost(pod) is not None)

    def remove(self, pod: PodRecord) -> None:
        """Delete a pod; force it when it has finished or no kubelet can confirm (``may_force_delete``)."""
        force = self.may_force_delete(pod)
        if pod.deleting and not force:
            return
        grace = 0 if (pod.finished or force) else None
        self.delete.append(Deletion("Pod", pod.name, grace))

    def remove_active(self, *, keep_finished: bool = True) -> None:
        """Stop every running pod of the job (workers and store)."""
        for pod in self.observed.pods:
            if pod.active or (not keep_finished and not pod.deleting):
                self.remove(pod)

    def ensure(self, obj: Object | None) -> None:
        """Apply an object that is missing or differs from what we last applied."""
        if obj is None:
            return
        record = self.observed.objects.get((child_kind(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"]))
        if record is not None and record.spec_hash == obj["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION]:
            return
        if record is not None or self.may_create(obj):
            self.apply.append(obj)

    def may_create(self, obj: Object) -> bool:
        """Whether to create a child now: not while its name is held by an object we do not own,
        nor before the pause after a refusal has passed (the reason goes to status)."""
        kind, name = child_kind(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"]
        if (kind, name) in self.observed.foreign:
            self.blocked.append(
                (
                    "NameConflict",
                    f"{kind} {name} exists but is not controlled by this TrainingJob (uid "
                    f"{self.job.metadata.uid}); it is left alone and the job waits until it is gone",
                )
            )
            return False
        refusal = self.observed.refusals.get((kind, name))
        if refusal is not None:
            # The refusal stands until a creation succeeds, so status does not flap at each retry.
            self.blocked.append((refusal.reason, f"creating {kind} {name}: {refusal.message}"))
        if kind == "Pod":
            return self.take_pod_budget()
        if refusal is None:
            return True
        retry_at = refusal_retry_at(refusal)
        if retry_at > self.now and not refusal.retry_now:
            self.requeue.append((retry_at - self.now).total_seconds())
            return False
        return True

    def take_pod_budget(self) -> bool:
        """Whether one more pod may be created in this pass (slow start after refusals)."""
        if not self.pod_budget_known:
            self.pod_budget, self.pod_budget_known = self.first_pod_budget(), True
        if self.pod_budget is None:
            return True
        if self.pod_budget <= 0:
            return False
        self.pod_budget -= 1
        return True

    def first_pod_budget(self) -> int | None:
        """No limit while no pod of the job is refused. Else none until the pause after the job's
        latest refusal has passed (a pod leaving the namespace shortens it to the first pause),
        then ``retry_batch`` pods; a creation that passed since the latest refusal opens it at once."""
        refused = [refusal for (kind, _), refusal in self.observed.refusals.items() if kind == "Pod"]
        if not refused:
            return None
        batch = max(1, self.observed.retry_batch)
        if batch > 1:
            return batch
        latest = max(refused, key=lambda refusal: (refusal.last, refusal.attempts))
        retry_at = refusal_retry_at(latest)
        if latest.retry_now:
            retry_at = min(retry_at, latest.last + timedelta(seconds=REFUSAL_RETRY_SECONDS[0]))
        if retry_at > self.now:
            self.requeue.append((retry_at - self.now).total_seconds())
            return 0
        return batch

    def count(self, failure: Failure, *pods: PodRecord) -> None:
        """Record one failure event (once: the UIDs of all its pods go into status in the same write)."""
        self.memory.by_reason[failure.reason] = self.memory.by_reason.get(failure.reason, 0) + 1
        if failure.counted:
            self.memory.restarts += 1
        self.memory.counted.update(pod.uid for pod in pods if pod.uid)

    def already_counted(self, pod: PodRecord) -> bool:
        return bool(pod.uid) and pod.uid in self.memory.counted

    def budget_exhausted(self) -> bool:
        return self.memory.restarts > self.spec.failure_policy.max_restarts

    def finish(self, phase: Literal["Succeeded", "Failed"], reason: str, message: str) -> PhaseView:
        self.memory.completion_time = format_time(self.now)
        self.memory.restart_not_before = None
        if phase == "Succeeded":
            self.wind_down(self.now)
        else:
            self.remove_active()
        kind: Literal["Normal", "Warning"] = "Normal" if phase == "Succeeded" else "Warning"
        self.events.append(Event(kind, reason, message))
        return PhaseView(phase, reason, message)

    # -- the pass --------------------------------------------------------------------------------

    def run(self) -> PhaseView:
        previous = self.job.status
        if previous.phase in TERMINAL:
            return self.after_finish(previous)
        try:
            launch = resolve_launch(self.spec)
            store = desired.rendezvous_store_pod(self.job, launch)
            group = desired.pod_group(self.job, launch, self.node_capacity_stamp())
            services = (desired.rendezvous_service(self.job), desired.workers_service(self.job))
            return self.run_with(launch, store, group, services)
        except PlanningError as error:
            return self.invalid(str(error))

    def node_capacity_stamp(self) -> str | None:
        """What the coscheduling PodGroup carries in ``phalanx.dev/node-capacity``: while a worker
        waits for a node it follows the nodes, so that new capacity updates the PodGroup and the
        scheduler tries the gang again at once; otherwise it stays as it was (no needless writes)."""
        if self.spec.gang.scheduler != "scheduler-plugins":
            return None
        kind = child_kind(desired.COSCHEDULING_API, "PodGroup")
        record = self.observed.objects.get((kind, naming.pod_group_name(self.job.metadata.name)))
        stamped = record.node_capacity if record is not None else None
        waiting = any(pod.unschedulable_message and not pod.deleting for pod in self.observed.workers())
        capacity_now = self.observed.node_capacity
        if not waiting or not capacity_now:
            return stamped
        # "<fingerprint>@<time>": a new stamp at most every NODE_CAPACITY_STAMP_SECONDS per job
        fingerprint, _, written = (stamped or "").partition("@")
        if fingerprint == capacity_now:
            return stamped
        try:
            last = parse_time(written)
        except ValueError:
            last = None
        due = last + timedelta(seconds=NODE_CAPACITY_STAMP_SECONDS) if last is not None else self.now
        if due > self.now:
            self.requeue.append((due - self.now).total_seconds())
            return stamped
        return f"{capacity_now}@{format_time(self.now)}"

    def wind_down(self, completed: datetime) -> None:
        """After success the other workers are finishing too (and may still need the store for
        torchrun's shutdown): give them a grace period before stopping what still runs."""
        remaining = (completed + timedelta(seconds=SUCCESS_GRACE_SECONDS) - self.now).total_seconds()
        if remaining > 0 and any(pod.active for pod in self.observed.workers()):
            self.requeue.append(remaining)
        else:
            self.remove_active()

    def after_finish(self, previous: api.TrainingJobStatus) -> PhaseView:
        completed = parse_time(previous.completion_time)
        if previous.phase == "Succeeded" and completed is not None:
            self.wind_down(completed)
        else:
            self.remove_active()
        ttl = self.spec.ttl_seconds_after_finished
        if ttl is not None and completed is not None:
            remaining = (completed + timedelta(seconds=ttl) - self.now).total_seconds()
            if remaining <= 0:
                self.delete_job = True
            else:
                self.requeue.append(remaining)
        assert previous.phase in TERMINAL
        return PhaseView(previous.phase, previous.reason or previous.phase, previous.message or "")

    def invalid(self, message: str) -> PhaseView:
        if any(pod.active for pod in self.observed.workers()):
            # Never kill a running job because a later operator version cannot plan its spec.
            self.stalled = ("InvalidSpec", message)
            self.apply.clear()
            self.delete.clear()
            previous = self.job.status
            return PhaseView(previous.phase or "Running", previous.reason or "InvalidSpec", previous.message or message)
        self.apply.clear()
        self.delete.clear()
        return self.finish("Failed", "InvalidSpec", message)

    def run_with(
        self, launch: Launch, store: Object, group: Object | None, services: tuple[Object, Object | None]
    ) -> PhaseView:
        previous = self.job.status
        spec = self.spec
        if spec.suspend:
            self.remove_active()
            if previous.phase != "Suspended":
                self.events.append(Event("Normal", "Suspended", "job suspended: all pods stopped"))
            return PhaseView("Suspended", "Suspended", "spec.suspend is true")
        if previous.phase == "Suspended":
            # A resumed job starts a new rendezvous; suspension never costs budget, nor deadline:
            # as batch/v1 resets startTime on resume, activeDeadlineSeconds counts from the next start.
            self.memory.attempt += 1
            self.memory.start_time = None
            self.events.append(Event("Normal", "Resumed", f"job resumed as attempt {self.memory.attempt}"))
        self.watch_nodes()

        attempt = self.memory.attempt
        workers = self.observed.workers()
        current = [pod for pod in workers if pod.attempt == attempt]
        stale = [pod for pod in workers if pod.attempt != attempt]
        for pod in stale:
            self.remove(pod)

        completed = self.completed(current)
        if completed is not None:
            return self.finish("Succeeded", "Succeeded", completed)

        started = parse_time(self.memory.start_time)
        deadline = spec.active_deadline_seconds
        if deadline is not None and started is not None:
            remaining = (started + timedelta(seconds=deadline) - self.now).total_seconds()
            if remaining <= 0:
                return self.finish(
                    "Failed", "DeadlineExceeded", f"job ran longer than activeDeadlineSeconds ({deadline})"
                )
            self.requeue.append(remaining)

        view = self.handle_failures(current) or self.no_progress(current)
        if view is not None:
            return view

        if group is not None and group["apiVersion"] in self.observed.missing_apis:
            why = self.observed.missing_apis[group["apiVersion"]]
            message = (
                f"gang.scheduler is {spec.gang.scheduler}, but PodGroups ({group['apiVersion']}) are {why}: "
                f"install {spec.gang.scheduler} or set gang.scheduler to none; the job starts once the API is there"
            )
            self.stalled = ("GangSchedulerUnavailable", message)
            return PhaseView("Pending", "GangSchedulerUnavailable", message)
        self.ensure(group)
        self.ensure(desired.job_network_policy(self.job, launch, self.observed.isolation))
        for service in services:
            self.ensure(service)
        store_pod = self.observed.store()
        if store_pod is not None and (store_pod.deleting or self.already_counted(store_pod)):
            # Workers that dialled the old store would lose it again as it goes.
            return PhaseView("Restarting", "GangRestart", "waiting for the old rendezvous store to stop")
        if store_pod is None and self.may_create(store):
            self.apply.append(store)
        # Workers only once the job's own store exists: a store it never had is not lost, and
        # workers must not dial a name a predecessor's store still holds.
        waiting_for_store = store_pod is None
        if waiting_for_store:  # a spec whose workers cannot be planned fails before anything is created
            desired.worker_pod(self.job, launch, index=0, attempt=attempt)

        not_before = parse_time(self.memory.restart_not_before)
        if not_before is not None and not_before > self.now:
            self.requeue.append((not_before - self.now).total_seconds())
            return PhaseView("Restarting", "Backoff", f"attempt {attempt} starts at {self.memory.restart_not_before}")
        if stale:
            message = f"waiting for {len(stale)} old worker(s) to stop"
            stuck = next((pod for pod in stale if pod.node_name and self.node_lost(pod) is not None), None)
            if stuck is not None:
                message += (
                    f"; {stuck.name} is on node {stuck.node_name}, which {self.node_lost(stuck)}: it stops when "
                    "the node comes back or is deleted (its container may still run, so it is not force-deleted)"
                )
            return PhaseView("Restarting", "GangRestart", message)
        if group is not None and not self.observed.has(
            child_kind(group["apiVersion"], group["kind"]), group["metadata"]["name"]
        ):
            return PhaseView("Pending", "WaitingForPodGroup", "waiting for the PodGroup to exist")

        resized = self.kueue_group_resized(current)
        if resized is not None:
            return self.gang_restart(current, [], store_lost=False, cause=resized)
        if not waiting_for_store:
            self.scale(launch, current)
        return self.running_phase(launch, current, store_pod)

    def completed(self, current: list[PodRecord]) -> str | None:
        """Why training is known to have completed, or None.

        A worker of the current attempt that exited 0 says so, and so does the record a rank
        leaves in the rendezvous store when it finished every step: that one also holds when the
        rank then died in teardown and the agents are left waiting for a world that cannot form.
        Anything that reaches the store can write that key, so a record counts only when it names
        this job's UID and its current attempt.
        """
        # a worker stopped by a deletion or an eviction may exit 0 on SIGTERM: that is no success
        if any(pod.phase == "Succeeded" and not pod.deleting and pod.disruption_reason is None for pod in current):
            return "training completed"
        done = self.observed.completion
        if done is None or done.job_uid != self.job.metadata.uid or done.attempt != self.memory.attempt:
            return None
        where = f"rank {done.rank} recorded completion" if done.rank is not None else "completion was recorded"
        at = f" at step {done.step}" if done.step is not None else ""
        return f"training completed: {where}{at} (attempt {done.attempt}) in the rendezvous store"

    def handle_failures(self, current: list[PodRecord]) -> PhaseView | None:
        failures = [
            (pod, failure)
            for pod in current
            if not pod.deleting and (failure := classify(pod, node_lost=self.node_lost(pod))) is not None
        ]
        fatal = [failure for _, failure in failures if failure.action == "fail"]
        if fatal:
            return self.finish("Failed", fatal[0].reason, fatal[0].message)
        # Failures recorded by an earlier pass (the pod outlived its deletion, or the operator
        # stopped in between): remove the pod again, never count it again.
        for pod, _ in failures:
            if self.already_counted(pod):
                self.remove(pod)
        failures = [(pod, failure) for pod, failure in failures if not self.already_counted(pod)]
        store = self.observed.store()
        store_gone = store is None or store.finished or store.deleting or self.node_lost(store) is not None
        if store is not None and self.already_counted(store):
            # Declared lost, and the gang restarted for it (its node may be back by now): it goes,
            # and a new store comes before any worker of the new attempt.
            self.remove(store)
            store_gone = False
        # A store this job never had is not lost: its creation was refused, or its name is still held
        # by another owner's pod (a deleted predecessor's store, terminating). Workers wait for the
        # store (run_with), but an older operator created both in one pass.
        store_key = ("Pod", naming.rendezvous_name(self.job.metadata.name))
        never_created = store is None and (store_key in self.observed.refusals or store_key in self.observed.foreign)
        store_lost = bool(current) and store_gone and not never_created
        # Workers someone else deleted (kubectl, a drain) are lost too, though they failed nothing;
        # a kubelet marks them Failed before they go, so "finished" does not tell them apart from
        # pods this operator removed: those were recorded as handled (or are beyond desired).
        deleted = [
            pod
            for pod in current
            if pod.deleting
            and not self.already_counted(pod)
            and pod.index is not None
            and pod.index < self.spec.workers.desired
        ]
        if not failures and not store_lost and not deleted:
            return None
        failed = {pod.name for pod, _ in failures}
        survivors = [pod for pod in current if pod.active and pod.name not in failed and not self.already_counted(pod)]
        # A Kueue pod group has a fixed size and is never refilled: losing a worker ends it.
        fixed_group = self.spec.gang.scheduler == "kueue"
        if store_lost or len(survivors) < self.spec.workers.min or fixed_group:
            return self.gang_restart(current, failures, store_lost=store_lost)
        if not failures:
            return None  # enough survivors: the deleted workers' slots are refilled once they are gone
        event = failure_event(failures)
        self.count(event, *(pod for pod, _ in failures))
        for pod, failure in failures:
            self.remove(pod)
            self.events.append(
                Event(
                    "Warning",
                    worker_event_reason(failure.reason),
                    f"{failure.message}; replacing it, {len(survivors)} worker(s) train on",
                )
            )
        if self.budget_exhausted():
            return self.finish(
                "Failed",
                "RestartBudgetExhausted",
                f"{self.memory.restarts} counted failures exceed failurePolicy.maxRestarts "
                f"({self.spec.failure_policy.max_restarts}); last: {event.message}",
            )
        return None

    def no_progress(self, current: list[PodRecord]) -> PhaseView | None:
        """Hang detection (failurePolicy.progressDeadlineSeconds): a Running job whose reporting worker
        has shown the same step count for the whole deadline restarts its gang, counted. The clock
        starts no earlier than the job last became Running (Ready), so a world that re-formed gets
        the whole deadline for its first step; a job whose workers serve no step count is never
        judged. Only a fresh sample is a verdict: when the reporter stopped answering (a
        NetworkPolicy, its port taken after a restart, a network blip) its last count says nothing
        about training since, so the job is left alone and Stalled says why (ProgressUnknown)."""
        deadline = self.spec.failure_policy.progress_deadline_seconds
        progress = self.observed.progress
        if deadline is None or self.job.status.phase != "Running" or progress is None:
            return None
        if progress.attempt != self.memory.attempt or progress.steps is None or progress.stepped_since is None:
            return None
        since = progress.stepped_since
        ready = next((c for c in self.job.status.conditions or [] if c.type == "Ready" and c.status == "True"), None)
        became_ready = parse_time(ready.last_transition_time) if ready is not None else None
        if became_ready is not None and became_ready > since:
            since = became_ready
        idle = (self.now - since).total_seconds()
        reporter = next((pod for pod in current if pod.uid == progress.reporter), None)
        if idle < deadline:
            self.requeue.append(deadline - idle)
            return None
        if progress.fresh_until is None or self.now > progress.fresh_until:
            # The poller wakes the job when the reporter answers again; then it is judged.
            last = format_time(progress.scraped_at) if progress.scraped_at is not None else "never"
            self.stalled = (
                "ProgressUnknown",
                f"hang detection (failurePolicy.progressDeadlineSeconds {deadline}) cannot judge: "
                f"{reporter.name if reporter else 'the reporting worker'} last answered a progress scrape at {last}"
                f"{f' ({progress.unanswered} unanswered since)' if progress.unanswered else ''}, "
                f"with its step count at {progress.steps}; nothing is restarted on stale data",
            )
            return None
        failure = Failure(
            "NoProgress",
            counted=True,
            action="replace",
            message=f"no training step for {int(idle)}s (failurePolicy.progressDeadlineSeconds is {deadline}): "
            f"{reporter.name if reporter else 'the reporting worker'}'s step count stayed at {progress.steps}",
        )
        return self.gang_restart(current, [], store_lost=False, cause=failure)

    def gang_restart(
        self,
        current: list[PodRecord],
        failures: list[tuple[PodRecord, Failure]],
        *,
        store_lost: bool,
        cause: Failure | None = None,
    ) -> PhaseView:
        store = self.observed.store()
        if cause is not None:
            failure = cause
        elif failures:
            failure = failure_event(failures)
        elif store_lost:
            failure = Failure(
                "RendezvousStoreLost", counted=False, action="replace", message="the rendezvous store pod was lost"
            )
        elif (workload := self.observed.workload) is not None and workload.evicted:
            failure = Failure(  # Kueue deletes an evicted or preempted group's pods
                "Evicted",
                counted=False,
                action="replace",
                message=f"Kueue evicted Workload {workload.name} ({workload.evicted}); the gang is queued again",
            )
        else:
            failure = Failure(
                "WorkersDeleted",
                counted=False,
                action="replace",
                message="worker pods were deleted from outside the operator",
            )
        lost = [pod for pod, _ in failures] + ([store] if store_lost and store is not None else [])
        self.count(failure, *lost)
        if (workload := self.observed.workload) is not None and workload.evicted:
            # Kueue took the quota back: in batch/v1 terms the job was suspended, so the
            # activeDeadlineSeconds clock starts again when the re-admitted gang trains.
            self.memory.start_time = None
        if self.budget_exhausted():
            return self.finish(
                "Failed",
                "RestartBudgetExhausted",
                f"{self.memory.restarts} counted failures exceed failurePolicy.maxRestarts "
                f"({self.spec.failure_policy.max_restarts}); last: {failure.message}",
            )
        self.memory.attempt += 1
        wait = backoff_seconds(self.spec.failure_policy, self.memory.restarts) if failure.counted else 0
        self.memory.restart_not_before = format_time(self.now + timedelta(seconds=wait)) if wait else None
        for pod in current:
            self.remove(pod)
        if store_lost and store is not None:
            self.remove(store)
        message = (
            f"{failure.message}; fewer than min ({self.spec.workers.min}) workers remain, "
            f"restarting the gang as attempt {self.memory.attempt}"
        )
        if store_lost or (cause is not None and self.spec.gang.scheduler != "kueue"):
            message = f"{failure.message}; restarting the gang as attempt {self.memory.attempt}"
        elif self.spec.gang.scheduler == "kueue":
            message = f"{failure.message}; restarting the gang as attempt {self.memory.attempt} (a new Kueue pod group)"
        if wait:
            message += f" after {wait}s"
            self.requeue.append(float(wait))
        # a hang is named by its own reason: it is what the user must look into
        self.events.append(Event("Warning", "NoProgress" if failure.reason == "NoProgress" else "GangRestart", message))
        return PhaseView("Restarting", failure.reason, message)

    def kueue_group_resized(self, current: list[PodRecord]) -> Failure | None:
        """A Kueue pod group keeps the size it was admitted with: a new workers.desired needs a
        new group, so the gang restarts (not counted) as one of the new size."""
        if self.spec.gang.scheduler != "kueue":
            return None
        sizes = {pod.group_total for pod in current if pod.active and pod.group_total is not None}
        wanted = self.spec.workers.desired
        if not sizes or sizes == {wanted}:
            return None
        return Failure(
            "Rescaling",
            counted=False,
            action="replace",
            message=f"workers.desired is {wanted} and a Kueue pod group of {max(sizes)} cannot change its size",
        )

    def scale(self, launch: Launch, current: list[PodRecord]) -> None:
        spec = self.spec
        wanted = spec.workers.desired
        kueue_total: int | None = None
        if spec.gang.scheduler == "kueue":
            totals = {pod.group_total for pod in current if pod.group_total is not None}
            kueue_total = totals.pop() if len(totals) == 1 else wanted
        taken = {pod.name for pod in self.observed.workers()}
        for index in range(wanted):
            if naming.worker_pod_name(self.job.metadata.name, index) in taken:
                continue
            worker = desired.worker_pod(
                self.job, launch, index=index, attempt=self.memory.attempt, kueue_total=kueue_total
            )
            if self.may_create(worker):
                self.apply.append(worker)
        surplus = sorted(
            (pod for pod in current if pod.active and pod.index is not None and pod.index >= wanted),
            key=lambda pod: -(pod.index or 0),
        )
        for pod in surplus:
            self.remove(pod)
        before = self.job.status.workers.desired if self.job.status.workers else None
        if before and before != wanted:
            self.rescaled = "up" if wanted > before else "down"
            self.events.append(Event("Normal", "Rescaling", f"desired workers changed from {before} to {wanted}"))

    def running_phase(self, launch: Launch, current: list[PodRecord], store: PodRecord | None) -> PhaseView:
        view = self.progress_phase(current, store)
        if not self.blocked:
            return self.beyond_capacity(launch, view, current)
        # Children we could not create: say why, and whether the job can train at all.
        reason, first = self.blocked[0]
        message = first if len(self.blocked) == 1 else f"{first} (and {len(self.blocked) - 1} more)"
        active = sum(1 for pod in current if pod.active)
        if view.phase not in TRAINING and active < self.spec.workers.min:
            message += (
                f"; the job holds {active} of the {self.spec.workers.min} worker(s) it needs (workers.min) "
                "and cannot train until the rest can be created"
            )
        else:
            message = f"{view.message}; {message}"
        self.stalled = (reason, message)
        return PhaseView(view.phase, reason, message)

    def beyond_capacity(self, launch: Launch, view: PhaseView, current: list[PodRecord]) -> PhaseView:
        """Stalled when what the job waits for can never come: more workers than the schedulable
        nodes can hold, or a gang larger than its Kueue queue's whole quota. It clears by itself
        when nodes (or quota) grow."""
        if view.phase not in ("Pending", "Rescaling"):
            return view
        workload = self.observed.workload
        if view.reason == "Queued" and workload is not None and "maximum capacity" in (workload.message or ""):
            self.stalled = ("ExceedsQueueCapacity", f"{view.message}; it can never be admitted as it is")
            return PhaseView(view.phase, *self.stalled)
        if not any(pod.unschedulable_message for pod in current if pod.active):
            return view  # the scheduler has not given up on any worker
        wanted = self.spec.workers.desired
        why = capacity.shortfall(desired.worker_requests(self.job, launch), self.observed.node_allocatable, wanted)
        if why is None:
            return view
        self.stalled = ("InsufficientCapacity", why)
        return PhaseView(view.phase, "InsufficientCapacity", f"{view.message}; {why}")

    def progress_phase(self, current: list[PodRecord], store: PodRecord | None) -> PhaseView:
        minimum, wanted = self.spec.workers.min, self.spec.workers.desired
        active = [pod for pod in current if pod.active]
        ready = [pod for pod in active if pod.ready]
        finishing = [pod for pod in active if pod.exit_code == 0 and pod.disruption_reason is None]
        if finishing:
            # A worker's container exited 0 and the kubelet has yet to mark its pod Succeeded, or its
            # peers are still shutting down: training is ending, not starting again.
            previous = self.job.status.phase
            others = len(active) - len(finishing)
            return PhaseView(
                previous if previous in TRAINING else "Running",
                "Completing",
                f"{finishing[0].name} finished training; waiting for {others} other worker(s) to finish",
            )
        if len(ready) >= minimum and store is not None and store.ready:
            if self.memory.start_time is None:
                self.memory.start_time = format_time(self.now)
            if len(active) == wanted and len(ready) == wanted:
                return PhaseView("Running", "WorkersReady", f"{len(ready)} worker(s) training")
            return PhaseView("Rescaling", "Rescaling", f"{len(ready)} worker(s) training, converging to {wanted}")
        workload = self.observed.workload
        if workload is not None and not workload.admitted and active:
            why = f": {workload.message}" if workload.message else ""
            return PhaseView(
                "Pending",
                "Queued",
                f"Kueue holds the gang in LocalQueue {self.spec.gang.queue} (Workload {workload.name}){why}",
            )
        if any(pod.scheduled for pod in active):
            return PhaseView("Starting", "WorkersStarting", f"{len(ready)} of at least {minimum} worker(s) ready")
        unschedulable = next((pod.unschedulable_message for pod in active if pod.unschedulable_message), None)
        if unschedulable:
            return PhaseView("Pending", "Unschedulable", unschedulable)
        return PhaseView("Pending", "WorkersPending", f"waiting for {minimum} worker(s) to be scheduled")

    # -- rendering -------------------------------------------------------------------------------

    def training_seconds(self, view: PhaseView) -> int:
        """Seconds spent training (Running or Rescaling) up to the last time the job left training.

        Together with the Running condition's lastTransitionTime this gives goodput without a
        clock in the operator's memory, so it survives operator restarts.
        """
        previous = self.job.status
        total = previous.training_seconds
        was_training = previous.phase in TRAINING
        if was_training and view.phase not in TRAINING:
            running = next((c for c in previous.conditions or [] if c.type == "Running"), None)
            since = parse_time(running.last_transition_time) if running is not None else None
            if since is not None:
                total += max(0, int((self.now - since).total_seconds()))
        return total

    def render_progress(self, view: PhaseView, status: dict[str, Any]) -> None:
        """World size and last checkpoint from what a worker reported. The world size is shown
        only while the current attempt trains; the last checkpoint stays until a newer one."""
        previous = self.job.status
        progress = self.observed.progress
        current = progress if progress is not None and progress.attempt == self.memory.attempt else None
        if current is not None and current.world_size and view.phase in TRAINING:
            status["workers"]["worldSize"] = current.world_size
        elif previous.workers is not None and previous.workers.world_size is not None:
            status["workers"]["worldSize"] = None  # merge patch: remove it
        if progress is None or progress.checkpoint_step is None or progress.checkpoint_time is None:
            return
        last = previous.last_checkpoint
        step, committed = progress.checkpoint_step, format_time(progress.checkpoint_time)
        # RFC 3339 UTC strings order as times; an older report (a lagging worker) never wins
        if last is None or (committed >= last.time and (last.step, last.time) != (step, committed)):
            status["lastCheckpoint"] = {"step": step, "time": committed}

    def render(self, view: PhaseView) -> Plan:
        job, memory = self.job, self.memory
        previous = job.status
        attempt_workers = [pod for pod in self.observed.workers() if pod.attempt == memory.attempt]
        active = [pod for pod in attempt_workers if pod.active]
        deleted = {deletion.name for deletion in self.delete}
        still_active = [pod for pod in active if pod.name not in deleted]
        ready = sum(1 for pod in still_active if pod.ready)
        wanted = self.spec.workers.desired
        stalled_before = next((c for c in previous.conditions or [] if c.type == "Stalled"), None)
        if self.stalled is not None and (
            stalled_before is None or stalled_before.status != "True" or stalled_before.reason != self.stalled[0]
        ):
            self.events.append(Event("Warning", *self.stalled))
        if view.phase != previous.phase and not self.events:
            troubled = view.phase in ("Failed", "Restarting") or self.stalled is not None
            kind: Literal["Normal", "Warning"] = "Warning" if troubled else "Normal"
            self.events.append(Event(kind, view.reason, f"{previous.phase or 'New'} -> {view.phase}: {view.message}"))
        tool = job.metadata.gitops_tool()
        if previous.phase is None and tool is not None and self.spec.ttl_seconds_after_finished is not None:
            self.events.append(
                Event(
                    "Warning",
                    "TTLUnderGitOps",
                    f"ttlSecondsAfterFinished deletes this job when it ends, and {tool} will create it again "
                    "from Git, so it trains again: leave the TTL unset and remove finished jobs from Git",
                )
            )
        status: dict[str, Any] = {
            "observedGeneration": job.metadata.generation,
            "phase": view.phase,
            "reason": view.reason,
            "message": view.message,
            "attempt": memory.attempt,
            "restarts": memory.restarts,
            "restartsByReason": dict(sorted(memory.by_reason.items())),
            # pruned to pods that still exist: a UID never comes back once its pod is gone
            "countedFailures": sorted(memory.counted & {pod.uid for pod in self.observed.pods}) or None,
            "workers": {
                "desired": wanted,
                "active": len(still_active),
                "ready": ready,
            },
            "replicas": len(still_active),
            "selector": naming.worker_selector(job.metadata.name),
            "workerSummary": f"{ready}/{wanted}",
            "conditions": conditions(
                previous.conditions,
                view,
                generation=job.metadata.generation,
                now=self.now,
                stalled_override=self.stalled,
            ),
        }
        status["trainingSeconds"] = self.training_seconds(view)
        self.render_progress(view, status)
        for key, value in (
            ("startTime", memory.start_time),
            ("completionTime", memory.completion_time),
            ("restartNotBefore", memory.restart_not_before),
        ):
            status[key] = value
        return Plan(
            apply=tuple(self.apply),
            delete=tuple(dict.fromkeys(self.delete)),
            status=status,
            events=tuple(self.events),
            requeue_after=min(self.requeue) if self.requeue else None,
            delete_job=self.delete_job,
            rescaled=self.rescaled,
        )


def plan(job: api.TrainingJob, observed: Observed, now: datetime) -> Plan:
    """Plan one reconcile pass. Never raises for a bad spec: that becomes a Failed job."""
    if job.metadata.deletion_timestamp is not None:
        return Plan()
    one = _Pass(job, observed, now)
    return one.render(one.run())


def status_changed(current: api.TrainingJobStatus | dict[str, Any] | None, proposed: dict[str, Any]) -> bool:
    """Whether writing ``proposed`` would change the stored status."""
    if isinstance(current, api.TrainingJobStatus):
        current = current.model_dump(by_alias=True, exclude_none=True)
    current = current or {}
    return any(
        current.get(key) != value for key, value in proposed.items() if not (value is None and key not in current)
    )


# Status keys that only report progress (counts and their wording); everything else (phase,
# reason, conditions, attempt, counters, counted failures) is a decision and is written at once.
PROGRESS_KEYS = frozenset({"message", "workers", "replicas", "workerSummary", "trainingSeconds", "lastCheckpoint"})


def progress_only(current: api.TrainingJobStatus | dict[str, Any] | None, proposed: dict[str, Any]) -> bool:
    """Whether ``proposed`` differs from the stored status in progress alone: the same phase,
    reason and decisions, conditions that differ at most in their messages. Such a write may wait
    a moment and carry the next ones with it."""
    if isinstance(current, api.TrainingJobStatus):
        current = current.model_dump(by_alias=True, exclude_none=True)
    current = current or {}
    for key, value in proposed.items():
        if key == "workers" and (current.get(key) or {}).get("desired") != (value or {}).get("desired"):
            return False  # a rescale: the next pass tells it from the stored desired count
        if key in PROGRESS_KEYS or (value is None and key not in current):
            continue
        if key == "conditions":
            if _condition_verdicts(current.get(key)) != _condition_verdicts(value):
                return False
        elif current.get(key) != value:
            return False
    return True


def _condition_verdicts(conditions: Any) -> dict[str, tuple[Any, ...]]:
    return {
        c.get("type"): (c.get("status"), c.get("reason"), c.get("observedGeneration"), c.get("lastTransitionTime"))
        for c in conditions or []
    }


def fail(job: api.TrainingJob, observed: Observed, now: datetime, reason: str, message: str) -> Plan:
    """A plan that ends the job as Failed for a reason found outside the planner (a refused pod)."""
    one = _Pass(job, observed, now)
    return one.render(one.finish("Failed", reason, message))


def unparsable(body: dict[str, Any], message: str, now: datetime) -> Plan:
    """The plan for a TrainingJob the operator cannot parse (a field from a newer CRD, say).

    Nothing is created or deleted and the job never ends here: it keeps its phase and counters,
    and is only marked ``Stalled`` with the reason, so an operator that can parse it carries on
    with the same pods.
    """
    metadata = body.get("metadata") or {}
    generation = int(metadata.get("generation") or 0)
    raw = body.get("status") or {}
    try:
        previous = api.TrainingJobStatus.model_validate(raw)
    except ValueError:  # a status written by a newer operator, too
        previous = api.TrainingJobStatus()
    phase: api.Phase = previous.phase or "Pending"
    view = PhaseView(phase, previous.reason or "InvalidSpec", previous.message or message)
    stalled = ("InvalidSpec", message)
    before = next((c for c in previous.conditions or [] if c.type == "Stalled"), None)
    events: tuple[Event, ...] = ()
    if before is None or before.status != "True" or before.reason != "InvalidSpec" or before.message != message:
        events = (Event("Warning", "InvalidSpec", f"{message}; the job and its pods are left as they are"),)
    status = {
        "observedGeneration": generation,
        "phase": phase,
        "conditions": conditions(previous.conditions, view, generation=generation, now=now, stalled_override=stalled),
    }
    return Plan(status=status, events=events)
