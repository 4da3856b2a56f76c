"""The planner's decisions: pure functions of (spec, observed children, remembered state, now).

Each decision returns a value: a ``Step`` (the remembered state after it, the deletions, Events and
requeues it asks for, and the phase when it ends the pass) or a plain answer. ``decide`` composes
them in one function whose order is the order of precedence:

1. a finished job winds down and waits for its TTL (``after_finish``);
2. a spec that cannot be planned stalls a running job, or fails one that runs nothing (``invalid``);
   one that can no longer have spares is planned without them once the job has trained (``Stalled``
   says why), so an edit never freezes its failure handling;
3. suspension; resumption starts a new attempt;
4. nodes: pods no kubelet can stop are force-deleted (``watch_nodes``); pods of old attempts go,
   except those an in-place gang restart keeps (``Context.still_keeps``), which are moved to the
   current attempt (by ``gang_restart`` itself when nothing is waited for; here once the backoff
   has passed and an old store is gone);
5. completion, then the active deadline;
6. failures (``handle_failures``): fatal ones fail the job, others replace the workers or restart
   the gang (``gang_restart``); else a hang (``no_progress``) restarts the gang;
7. what the job should have (PodGroup, NetworkPolicy, Services, store, worker slots, spares) and
   what holds workers back (an old store, backoff, old workers, a missing PodGroup, a Kueue group
   to resize); an empty slot is filled by promoting a ready spare (``spares``) even while old
   workers stop, since a spare has a name of its own;
8. the phase from the workers' progress and from what could not be created (``running_phase``).

The decisions live in ``restarts`` (failures, gang restarts, hangs), ``phase`` (scaling and the
phase), ``spares`` (promotions and the spares' upkeep) and here (the rest); the values they pass
in ``decision``. Nothing mutates shared state: a decision that is discarded (a ``PlanningError``
part way) costs nothing to undo. ``plan`` renders the result into the Plan and the next status.

Nodes: a pod is taken for lost with its node only when the node was deleted or has not been Ready
for the operator's grace (``NodeLoss``); a pod the taint manager evicts says so itself. A pod whose
container may still run is never force-deleted unless its node object is gone or the operator was
told to.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Literal

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import creation, desired, naming, restarts, slots, spares, topology
from phalanx.reconcile.actions import NOTHING, Actions, event, requeue
from phalanx.reconcile.creation import Wanted
from phalanx.reconcile.pass_values import Context, Decision, Memory, Step, concluded, finish, wind_down
from phalanx.reconcile.desired import Object
from phalanx.reconcile.environment import Launch, resolve_launch
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.observed import Observed, PodRecord, child_kind
from phalanx.reconcile.phase import running_phase, scaling
from phalanx.reconcile.restarts import gang_restart, handle_failures, kueue_group_resized, no_progress
from phalanx.reconcile.status import TERMINAL, PhaseView, format_time, parse_time

NODE_CAPACITY_STAMP_SECONDS = 10.0
"""Least time between two new node-capacity stamps on one waiting PodGroup: pods leave the cluster
all the time, and each would otherwise cost every waiting gang a PodGroup write."""


def decide(job: api.TrainingJob, observed: Observed, now: datetime) -> Decision:
    """Everything one pass decides, in order of precedence (see the module's docstring)."""
    context = Context(job, observed, now)
    memory = Memory.of(job.status)
    if job.status.phase in TERMINAL:
        return after_finish(context, memory)
    try:
        launch = resolve_launch(context.spec)
        refusal = desired.spares_refusal(context.spec, launch) if context.spec.workers.spares else ""
        trained = memory.start_time is not None or any(pod.active for pod in context.observed.workers())
        if refusal and not trained:
            raise PlanningError("spec.workers.spares", refusal)
        if refusal:  # made impossible mid-run (an edit): train on without spares, not frozen as ``invalid``
            context = replace(context, job=without_spares(context.job))
        decision = decide_active(replace(context, in_place=launch.supervised), memory, launch)
    except PlanningError as error:
        return invalid(context, memory, str(error))
    if refusal and decision.stall is None and decision.view.phase not in TERMINAL:
        decision = replace(
            decision, stall=("InvalidSpec", f"spec.workers.spares: {refusal}; training on without spares")
        )
    return replace(recording_removals(context, decision), restart_mode=launch.restart_mode)


def recording_removals(context: Context, decision: Decision) -> Decision:
    """The workers of the attempt that this pass deletes while the job goes on (a scale-down's
    surplus, a moved gang's unplaced pods) recorded in status, which is written before any
    deletion: a pod stopping or gone for the operator's own reasons is never taken for one deleted
    from outside (``handle_failures``), whatever happens to the operator in between. Failures are
    recorded as counted instead, and pods of older attempts are told apart by their attempt."""
    memory = decision.memory
    if decision.view.phase in (*TERMINAL, "Suspended"):
        return decision  # nothing of the attempt goes on
    deleted = {deletion.name for deletion in decision.actions.delete if deletion.kind == "Pod"}
    removed = [
        pod
        for pod in context.observed.workers()
        if pod.name in deleted
        and pod.attempt == memory.attempt
        and not pod.deleting  # already on its way: forced now, not deleted by this pass
        and not memory.already_counted(pod)
    ]
    return replace(decision, memory=memory.removing(removed)) if removed else decision


def without_spares(job: api.TrainingJob) -> api.TrainingJob:
    """The job as planned when its spec can no longer have spares: its spare pods go, and no new one comes."""
    workers = job.spec.workers.model_copy(update={"spares": 0})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"workers": workers})})


def decide_active(context: Context, memory: Memory, launch: Launch) -> Decision:
    job, spec, observed = context.job, context.spec, context.observed
    memory = memory.avoiding_until(context.now).resumed(observed.progress)
    # created only in a pass that handles no failure, so the nodes avoided so far are all there are
    store = desired.rendezvous_store_pod(job, launch, avoid=memory.avoided_nodes)
    stamp, actions = node_capacity_stamp(context)
    if memory.avoided:  # status drops the node when its time is up
        ends = min(parse_time(entry.until) or context.now for entry in memory.avoided)
        actions += requeue(max(0.0, (ends - context.now).total_seconds()))
    group = desired.pod_group(job, launch, stamp)
    services = (desired.rendezvous_service(job), desired.workers_service(job))

    if spec.suspend:
        actions += context.removing_active()
        if job.status.phase != "Suspended":
            actions += event("Normal", "Suspended", "job suspended: all pods stopped")
        return Decision(PhaseView("Suspended", "Suspended", "spec.suspend is true"), memory, actions)
    if job.status.phase == "Suspended":
        # A resumed job starts a new rendezvous; suspension never costs budget, nor deadline:
        # as batch/v1 resets startTime on resume, activeDeadlineSeconds counts from the next start.
        memory = replace(memory, attempt=memory.attempt + 1, start_time=None)
        actions += event("Normal", "Resumed", f"job resumed as attempt {memory.attempt}")
    actions += watch_nodes(context)

    workers = observed.workers()
    current = [pod for pod in workers if pod.attempt == memory.attempt]
    stale = [pod for pod in workers if pod.attempt != memory.attempt]
    # kept through an in-place gang restart: moved to the current attempt below, never deleted
    moving = [pod for pod in stale if (pod.attempt or 0) < memory.attempt and context.still_keeps(pod, memory)]
    actions += context.removing(pod for pod in stale if pod not in moving)
    current, duplicates = slots.one_pod_per_slot(context, current)
    actions += duplicates
    memory = replace(memory, claims=slots.standing(context, memory, current))

    completed = completion(context, memory, current)
    if completed is not None:
        return concluded(actions, finish(context, memory, "Succeeded", "Succeeded", completed))
    deadline = active_deadline(context, memory)
    if deadline.view is not None:
        return concluded(actions, deadline)
    actions += deadline.actions

    step = handle_failures(context, memory, current)
    if step.view is None:
        hang = no_progress(context, step.memory, current)
        step = replace(hang, actions=step.actions + hang.actions)
    memory, actions, stall = step.memory, actions + step.actions, step.stall
    if step.view is not None:
        return Decision(step.view, memory, actions, stall=stall)

    devices = desired.device_claim_template(job)
    unavailable = missing_api(context, group, devices)
    if unavailable is not None:
        reason, message = unavailable
        return Decision(PhaseView("Pending", reason, message), memory, actions, stall=(reason, message))
    placed = topology.place(context, memory, launch, current)
    if placed.room is not None and placed.domain != memory.domain and spec.placement and spec.placement.topology:
        actions += event("Normal", "Placed", topology.placed_message(spec.placement.topology.key, placed))
    memory = replace(memory, domain=placed.domain)
    if placed.domain is not None:
        # unplaced pods pinned to another domain (the gang moved; again after a SIGKILL between the
        # status that recorded the move and their deletion) go, and come back in this one (not a restart)
        actions += context.removing(
            pod for pod in current if pod.active and not pod.node_name and pod.domain not in (None, placed.domain)
        )
    if placed.stall is not None and not any(pod.active for pod in current):
        reason, message = placed.stall
        return Decision(PhaseView("Pending", reason, message), memory, actions, stall=placed.stall)
    # the claim template never changes (gpus and network are immutable): created when missing
    # (again if someone deletes it), never applied over (the API server refuses changes to its spec)
    devices_missing = devices is not None and not observed.has(
        child_kind(devices["apiVersion"], devices["kind"]), devices["metadata"]["name"]
    )
    wanted = [Wanted(devices, create_only=True)] if devices is not None and devices_missing else []
    wanted += [
        Wanted(obj)
        for obj in (group, desired.job_network_policy(job, launch, observed.isolation), *services)
        if obj is not None
    ]

    def held(view: PhaseView, *, more: Actions = NOTHING, promoted: frozenset[str] = frozenset()) -> Decision:
        """The pass ends before workers: only the objects wanted so far are written; spares are
        tended (a failed one recorded, extra ones removed) but none is created."""
        writes = creation.writes(wanted, observed, job.metadata.uid, context.now)
        tended = spares.upkeep(context, memory, launch, promoted=promoted, may_create=False)
        return Decision(
            view,
            tended.memory,
            actions + more + tended.actions + writes.waits,
            apply=writes.apply,
            stall=stall,
        )

    store_pod = observed.store()
    if store_pod is not None and (store_pod.deleting or memory.already_counted(store_pod)):
        # Workers that dialled the old store would lose it again as it goes.
        return held(PhaseView("Restarting", "GangRestart", "waiting for the old rendezvous store to stop"))
    if store_pod is None:
        wanted.append(Wanted(store, create_only=True))
        # Workers only once the job's own store exists: a store it never had is not lost, and
        # workers must not dial a name a predecessor's store still holds. A spec whose workers
        # cannot be planned fails before anything is created.
        desired.worker_pod(job, launch, index=0, attempt=memory.attempt)

    not_before = parse_time(memory.restart_not_before)
    if not_before is not None and not_before > context.now:
        return held(
            PhaseView("Restarting", "Backoff", f"attempt {memory.attempt} starts at {memory.restart_not_before}"),
            more=requeue((not_before - context.now).total_seconds()),
        )
    if moving:
        # after the backoff and once an old store is gone (above): the moved pods' processes restart
        # at once and dial the attempt's store, which the launchers wait for if it is still starting
        message = f"restarting {len(moving)} worker(s) in place as attempt {memory.attempt}"
        leaving = [pod for pod in stale if pod not in moving]
        if leaving:
            message += "; " + old_workers_message(context, leaving)
        # the new attempt's rank addresses with the move, so the restarted agents need not wait a pass
        ranks_slices, addresses = topology.rank_addresses(context, memory, launch, moving)
        wanted.extend(Wanted(obj) for obj in ranks_slices)
        return held(
            PhaseView("Restarting", "GangRestart", message),
            more=restarts.moving(context, moving, memory.attempt) + addresses,
        )
    active = sum(1 for pod in current if pod.active)
    if stale and active < spec.workers.min:
        # a spare takes its slot now: its name is its own, so it need not wait for the old pod to go
        filled = spares.promotions(context, memory, current)
        return held(
            PhaseView("Restarting", "GangRestart", old_workers_message(context, stale)),
            more=filled.actions,
            promoted=filled.promoted,
        )
    # old workers still stopping hold nothing back once at least min workers of the attempt run
    # (a world re-formed in place trains on): a new pod for a slot waits for its old pod's name
    if group is not None and not observed.has(
        child_kind(group["apiVersion"], group["kind"]), group["metadata"]["name"]
    ):
        return held(PhaseView("Pending", "WaitingForPodGroup", "waiting for the PodGroup to exist"))
    if devices_missing:
        # a worker whose claim template is missing would wait unschedulable without a word of why
        return held(
            PhaseView(
                "Pending", "WaitingForDeviceClaims", "waiting for the ResourceClaimTemplate of the workers' devices"
            )
        )

    resized = kueue_group_resized(context, current)
    if resized is not None:
        restart = gang_restart(context, memory, current, [], store_lost=False, cause=resized)
        memory = restart.memory
        assert restart.view is not None
        return held(restart.view, more=restart.actions)

    rescaled: Literal["up", "down"] | None = None
    if store_pod is not None:
        scaled = scaling(context, memory, launch, current)
        wanted.extend(Wanted(worker, create_only=True) for worker in scaled.slots)
        actions += scaled.actions
        rescaled = scaled.rescaled
        kept_spares = spares.upkeep(context, memory, launch, promoted=scaled.promoted, may_create=scaled.placed)
        memory = kept_spares.memory
        wanted.extend(Wanted(spare, create_only=True) for spare in kept_spares.create)
        actions += kept_spares.actions
    ranks_slices, addresses = topology.rank_addresses(context, memory, launch, current)
    wanted.extend(Wanted(obj) for obj in (desired.ranks_service(job, launch), *ranks_slices) if obj is not None)
    actions += addresses
    writes = creation.writes(wanted, observed, job.metadata.uid, context.now)
    step = running_phase(context, memory, launch, current, store_pod, writes.blocked)
    assert step.view is not None
    return Decision(
        step.view,
        step.memory,
        actions + step.actions + writes.waits,
        apply=writes.apply,
        stall=step.stall or stall,
        rescaled=rescaled,
    )


def missing_api(context: Context, group: Object | None, devices: Object | None) -> tuple[str, str] | None:
    """Why the job cannot start because an API it needs is not served or not permitted (reason,
    message), or None: the gang scheduler's PodGroups, the ResourceClaimTemplates of DRA devices."""
    missing, spec = context.observed.missing_apis, context.job.spec
    if group is not None and group["apiVersion"] in missing:
        why = missing[group["apiVersion"]]
        return "GangSchedulerUnavailable", (
            f"gang.scheduler is {spec.gang.scheduler}, but PodGroups ({group['apiVersion']}) are {why}: "
            f"install {spec.gang.scheduler} or set gang.scheduler to none; the job starts once the API is there"
        )
    if devices is not None and devices["apiVersion"] in missing:
        why = missing[devices["apiVersion"]]
        return "DevicesUnavailable", (
            f"the job asks for DRA devices (gpus.deviceClassName or network.rdma.deviceClassName), but "
            f"ResourceClaimTemplates ({devices['apiVersion']}) are {why}: DRA needs Kubernetes 1.34 or later "
            "(or ask for GPUs by gpus.resource); the job starts once the API is there"
        )
    return None


def node_capacity_stamp(context: Context) -> tuple[str | None, Actions]:
    """What the coscheduling PodGroup carries in ``phalanx.dev/node-capacity``: while a worker
    waits for a node it follows the nodes, so that new capacity updates the PodGroup and the
    scheduler tries the gang again at once; otherwise it stays as it was (no needless writes)."""
    job, observed, now = context.job, context.observed, context.now
    if job.spec.gang.scheduler != "scheduler-plugins":
        return None, NOTHING
    kind = child_kind(desired.COSCHEDULING_API, "PodGroup")
    record = observed.objects.get((kind, naming.pod_group_name(job.metadata.name)))
    stamped = record.node_capacity if record is not None else None
    waiting = any(pod.unschedulable_message and not pod.deleting for pod in observed.workers())
    capacity_now = observed.node_capacity
    if not waiting or not capacity_now:
        return stamped, NOTHING
    # "<fingerprint>@<time>": a new stamp at most every NODE_CAPACITY_STAMP_SECONDS per job
    fingerprint, _, stamped_at = (stamped or "").partition("@")
    if fingerprint == capacity_now:
        return stamped, NOTHING
    try:
        last = parse_time(stamped_at)
    except ValueError:
        last = None
    due = last + timedelta(seconds=NODE_CAPACITY_STAMP_SECONDS) if last is not None else now
    if due > now:
        return stamped, requeue((due - now).total_seconds())
    return f"{capacity_now}@{format_time(now)}", NOTHING


def watch_nodes(context: Context) -> Actions:
    """Force-delete terminating pods no kubelet can confirm any more (``may_force_delete``), and
    come back when the grace of a not-ready node that holds an active pod of the job runs out."""
    observed, now = context.observed, context.now
    loss = observed.node_loss
    actions = NOTHING
    for pod in observed.pods:
        node = pod.node_name
        if pod.deleting and context.may_force_delete(pod):
            actions += context.removing([pod])
        if pod.active and node in observed.unready_nodes and node not in loss.deleted:
            since = loss.unready_since.get(node, now)
            remaining = (since + timedelta(seconds=loss.grace_seconds) - now).total_seconds()
            if remaining > 0:
                actions += requeue(remaining)
    return actions


def old_workers_message(context: Context, stale: list[PodRecord]) -> str:
    message = f"waiting for {len(stale)} old worker(s) to stop"
    stuck = next((pod for pod in stale if pod.node_name and context.node_lost(pod) is not None), None)
    if stuck is not None:
        message += (
            f"; {stuck.name} is on node {stuck.node_name}, which {context.node_lost(stuck)}: it stops when "
            "the node comes back or is deleted (its container may still run, so it is not force-deleted)"
        )
    return message


def completion(context: Context, memory: Memory, current: list[PodRecord]) -> str | None:
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
    done = context.observed.completion
    if done is None or done.job_uid != context.job.metadata.uid or done.attempt != memory.attempt:
        return None
    where = f"rank {done.rank} recorded completion" if done.rank is not None else "completion was recorded"
    at = f" at step {done.step}" if done.step is not None else ""
    return f"training completed: {where}{at} (attempt {done.attempt}) in the rendezvous store"


def active_deadline(context: Context, memory: Memory) -> Step:
    """activeDeadlineSeconds, counted from the start of training (``startTime``)."""
    started = parse_time(memory.start_time)
    deadline = context.spec.active_deadline_seconds
    if deadline is None or started is None:
        return Step(memory)
    remaining = (started + timedelta(seconds=deadline) - context.now).total_seconds()
    if remaining <= 0:
        return finish(
            context, memory, "Failed", "DeadlineExceeded", f"job ran longer than activeDeadlineSeconds ({deadline})"
        )
    return Step(memory, requeue(remaining))


def after_finish(context: Context, memory: Memory) -> Decision:
    """A finished job: stop what still runs, and delete the job when its TTL has passed."""
    previous = context.job.status
    completed = parse_time(previous.completion_time)
    if previous.phase == "Succeeded" and completed is not None:
        actions = wind_down(context, completed)
    else:
        actions = context.removing_active()
    delete_job = False
    ttl = context.spec.ttl_seconds_after_finished
    if ttl is not None and completed is not None:
        remaining = (completed + timedelta(seconds=ttl) - context.now).total_seconds()
        if remaining <= 0:
            delete_job = True
        else:
            actions += requeue(remaining)
    assert previous.phase in TERMINAL
    view = PhaseView(previous.phase, previous.reason or previous.phase, previous.message or "")
    return Decision(view, memory, actions, delete_job=delete_job)


def invalid(context: Context, memory: Memory, message: str) -> Decision:
    """A spec this operator cannot plan: never kill a running job for it (a later operator version
    may not plan an older spec); a job that runs nothing fails."""
    if any(pod.active for pod in context.observed.workers()):
        previous = context.job.status
        view = PhaseView(previous.phase or "Running", previous.reason or "InvalidSpec", previous.message or message)
        return Decision(view, memory, stall=("InvalidSpec", message))
    return concluded(NOTHING, finish(context, memory, "Failed", "InvalidSpec", message))
