"""Decisions about failures: replace failed workers while enough train on, restart the gang
(too few survivors, the store lost, a Kueue group, a hang), or end the job (a fatal failure, the
restart budget spent).

Exactly-once counting: every failure recorded in ``restarts``/``restartsByReason`` adds the failed
pod's UID to ``status.countedFailures`` in the same status write. A pod whose UID is there is never
counted again, however often the operator restarts, a delete fails or a late watch event shows it
once more; a UID leaves the record only when the pod is gone from a synced view, and UIDs are never
reused. The workers a pass finds failed are one failure event, counted once whether they are
replaced one by one or the gang restarts: correlated failures (an OOM at the same step, an NCCL
cascade) are one incident, and the count must not depend on how many workers survive it.

Crash safety: a gang restart is first recorded in status (a new attempt) and only then are the old
pods deleted. A crash in between leaves pods of an old attempt, which the next pass deletes as
stale without counting them again.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming, pod_patches, replica_groups, spares
from phalanx.reconcile.actions import NOTHING, Actions, event, requeue
from phalanx.reconcile.failures import Failure, classify
from phalanx.reconcile.observed import PodRecord
from phalanx.reconcile.pass_values import Avoidance, Context, Memory, Step, finish
from phalanx.reconcile.status import PhaseView, format_time, parse_time, stored_time

AVOIDANCE_MESSAGE = 256
"""Characters of the failure kept with an avoided node in status (the Event has it whole)."""


def handle_failures(context: Context, memory: Memory, current: list[PodRecord]) -> Step:
    """Workers that failed, a lost store, workers deleted from outside: fail the job (a fatal
    failure), restart the gang (too few survivors, the store lost, a Kueue group), or replace the
    failed workers while the others train on."""
    spec, observed = context.spec, context.observed
    failures = [
        (pod, failure)
        for pod in current
        if not pod.deleting and (failure := classify(pod, node_lost=context.node_lost(pod))) is not None
    ]
    fatal = [failure for _, failure in failures if failure.action == "fail"]
    if fatal:
        return finish(context, memory, "Failed", fatal[0].reason, fatal[0].message)
    # Failures recorded by an earlier pass (the pod outlived its deletion, or the operator
    # stopped in between): remove the pod again, never count it again.
    actions = context.removing(pod for pod, _ in failures if memory.already_counted(pod))
    failures = [(pod, failure) for pod, failure in failures if not memory.already_counted(pod)]
    store = observed.store()
    store_gone = store is None or store.finished or store.deleting or context.node_lost(store) is not None
    if store is not None and memory.already_counted(store):
        # Declared lost, and the gang restarted for it (its node may be back by now): it goes,
        # and a new store comes before any worker of the new attempt.
        actions += context.removing([store])
        store_gone = False
    # A store this job never had is not lost: its creation was refused, or its name is still held
    # by another owner's pod (a deleted predecessor's store, terminating). Workers wait for the
    # store (``stages.desired_objects``), but an older operator created both in one pass.
    store_key = ("Pod", naming.rendezvous_name(context.job.metadata.name))
    never_created = store is None and (store_key in observed.refusals or store_key in observed.foreign)
    store_lost = bool(current) and store_gone and not never_created
    # Workers someone else deleted (kubectl, a drain) are lost too, though they failed nothing;
    # a kubelet marks them Failed before they go, so "finished" does not tell them apart from
    # pods this operator removed: those are recorded in status before they are deleted, as
    # counted failures or as removed (``decide.recording_removals``); a slot beyond desired is no loss.
    deleted = [
        pod
        for pod in current
        if pod.deleting
        and not memory.already_counted(pod)
        and not memory.removed_itself(pod)
        and pod.index is not None
        and pod.index < spec.workers.desired
    ]
    if not failures and not store_lost and not deleted:
        return Step(memory, actions)
    # and the pods deleted for their node (the taint manager, the pod garbage collector), the lost store
    blamed = list(failures)
    for pod in [*deleted, *([store] if store_lost and store is not None else [])]:
        if (lost := classify(pod, node_lost=context.node_lost(pod))) is not None:
            blamed.append((pod, lost))
    memory, avoiding = avoid_nodes(context, memory, blamed)
    actions += avoiding
    if spec.replica_groups is not None and not store_lost:
        # replica groups fail alone while at least replicaGroups.min groups train on
        alone = replica_groups.restart_groups(context, memory, current, failures, deleted)
        if alone is None:  # too few groups train on: the whole gang, from the latest checkpoint
            gone = [pod for pod, _ in failures] + deleted
            why = replica_groups.shortfall(spec, memory, current, gone)
            alone = gang_restart(context, memory, current, failures, store_lost=False, shortfall=why)
        return replace(alone, actions=actions + alone.actions)
    failed = {pod.name for pod, _ in failures}
    survivors = [pod for pod in current if pod.active and pod.name not in failed and not memory.already_counted(pod)]
    # A Kueue pod group has a fixed size and is never refilled: losing a worker ends it.
    fixed_group = spec.gang.scheduler == "kueue"
    if store_lost or len(survivors) < spec.workers.min or fixed_group:
        restart = gang_restart(context, memory, current, failures, store_lost=store_lost)
        return replace(restart, actions=actions + restart.actions)
    lost_slots = sorted({pod.index for pod in [*(pod for pod, _ in failures), *deleted] if pod.index is not None})
    if context.in_place and lost_slots and all(context.keeps(pod, memory) for pod in survivors):
        # a slot a scale-down removes in this pass is lost, but no spare takes it
        kept_slots = [slot for slot in lost_slots if slot < spec.workers.desired]
        takers = list(zip(kept_slots, spares.ready_spares(context, memory), strict=False))
        reform = reform_in_place(context, memory, failures, survivors, takers)
        return replace(reform, actions=actions + reform.actions)
    if not failures:
        return Step(memory, actions)  # enough survivors: the deleted workers' slots are refilled once they are gone
    failure = failure_event(failures)
    memory = memory.counting(failure, (pod for pod, _ in failures))
    # the survivors' agents restart their processes too, from the latest checkpoint
    memory = memory.restarting_from(context.observed.progress, context.now)
    for pod, one in failures:
        actions += context.removing([pod]) + event(
            "Warning",
            worker_event_reason(one.reason),
            f"{one.message}; replacing it, {len(survivors)} worker(s) train on",
        )
    if memory.restarts > spec.failure_policy.max_restarts:
        exhausted = finish(
            context, memory, "Failed", "RestartBudgetExhausted", budget_message(context, memory, failure)
        )
        return replace(exhausted, actions=actions + exhausted.actions)
    return Step(memory, actions)


def reform_in_place(
    context: Context,
    memory: Memory,
    failures: list[tuple[PodRecord, Failure]],
    survivors: list[PodRecord],
    takers: list[tuple[int, PodRecord]],
) -> Step:
    """Workers lost while at least min survive, in a job that restarts in place: the world re-forms
    at once as a new attempt (a new rendezvous id), the survivors moved and ready spares promoted
    into the lost slots (``takers``) in this pass; slots no spare takes get new pods once their old
    ones are gone, and join the new world as torchrun lets a rendezvous grow.

    Re-forming under the old rendezvous id would wait for torchrun to give up on each lost agent
    (three missed keep-alives), since a round ends only when all its participants left; a new id
    starts a round of its own. The failure is counted as a replaced worker's (once, no backoff:
    nothing waits)."""
    spec = context.spec
    if failures:
        failure = failure_event(failures)
        memory = memory.counting(failure, (pod for pod, _ in failures))
    else:
        failure = gang_cause(context, [], store_lost=False, cause=None)
        memory = memory.counting(failure, ())
    if memory.restarts > spec.failure_policy.max_restarts:
        exhausted = finish(
            context, memory, "Failed", "RestartBudgetExhausted", budget_message(context, memory, failure)
        )
        return replace(exhausted, actions=context.removing(pod for pod, _ in failures) + exhausted.actions)
    memory = memory.restarting_from(context.observed.progress, context.now)
    memory = replace(memory, attempt=memory.attempt + 1, restart_not_before=None)
    actions = context.removing(pod for pod, _ in failures) + moving(context, survivors, memory.attempt)
    for slot, spare in takers:
        actions += spares.promoting(context, memory, spare, slot)
    how = f"{len(survivors)} worker(s) re-form the world in place as attempt {memory.attempt}"
    if takers:
        taken = ", ".join(f"{spare.name} takes slot {slot}" for slot, spare in takers)
        how = (
            f"{taken}; {len(survivors) + len(takers)} worker(s) re-form the world in place as attempt {memory.attempt}"
        )
    message = f"{failure.message}; {how}"
    # each failed worker its own Event, as when it is replaced; pods deleted from outside one
    for one in [one for _, one in failures] or [failure]:
        actions += event("Warning", worker_event_reason(one.reason), f"{one.message}; {how}")
    return Step(memory, actions, PhaseView("Restarting", failure.reason, message))


def avoid_nodes(context: Context, memory: Memory, failures: list[tuple[PodRecord, Failure]]) -> tuple[Memory, Actions]:
    """The nodes to blame for ``failures`` avoided for failurePolicy.avoidNodeSeconds (recorded in the
    same status write as the failures, so once), and an Event for each node newly avoided."""
    seconds = context.spec.failure_policy.avoid_node_seconds
    actions = NOTHING
    if not seconds:
        return memory, actions
    until = stored_time(context.now + timedelta(seconds=seconds))
    for pod, failure in failures:
        node = pod.node_name
        if failure.node_fault is None or not node:
            continue
        if node not in memory.avoided_nodes:
            actions += event(
                "Warning",
                "AvoidingNode",
                f"this job's new pods keep off node {node} until {format_time(until)} "
                f"({failure.node_fault}): {failure.message}",
            )
        memory = memory.avoiding(Avoidance(node, failure.node_fault, failure.message[:AVOIDANCE_MESSAGE], until))
    return memory, actions


def no_progress(context: Context, memory: Memory, current: list[PodRecord]) -> Step:
    """Hang detection (failurePolicy.progressDeadlineSeconds): a Running job whose reporting worker
    has shown the same step count for the whole deadline restarts its gang, counted. The clock
    starts no earlier than the job last became Running (Ready), so a world that re-formed gets
    the whole deadline for its first step; a job whose workers serve no step count is never
    judged. Only a sample scraped after the deadline ran out (``stepped_since`` plus the deadline)
    is a verdict: an older one shows the count before the deadline, whatever came after. And only
    a fresh sample is a verdict: when the reporter stopped answering (a
    NetworkPolicy, its port taken after a restart, a network blip) its last count says nothing
    about training since, so the job is left alone and Stalled says why (ProgressUnknown)."""
    job, now = context.job, context.now
    deadline = context.spec.failure_policy.progress_deadline_seconds
    progress = context.observed.progress
    if deadline is None or job.status.phase != "Running" or progress is None:
        return Step(memory)
    if progress.attempt != memory.attempt or progress.steps is None or progress.stepped_since is None:
        return Step(memory)
    since = progress.stepped_since
    ready = next((c for c in job.status.conditions or [] if c.type == "Ready" and c.status == "True"), None)
    became_ready = parse_time(ready.last_transition_time) if ready is not None else None
    if became_ready is not None and became_ready > since:
        since = became_ready
    idle = (now - since).total_seconds()
    reporter = next((pod for pod in current if pod.uid == progress.reporter), None)
    if idle < deadline:
        return Step(memory, requeue(deadline - idle))
    if progress.fresh_until is None or now > progress.fresh_until:
        # The poller wakes the job when the reporter answers again; then it is judged.
        last = format_time(progress.scraped_at) if progress.scraped_at is not None else "never"
        return Step(
            memory,
            stall=(
                "ProgressUnknown",
                f"hang detection (failurePolicy.progressDeadlineSeconds {deadline}) cannot judge: "
                f"{reporter.name if reporter else 'the reporting worker'} last answered a progress scrape at {last}"
                f"{f' ({progress.unanswered} unanswered since)' if progress.unanswered else ''}, "
                f"with its step count at {progress.steps}; nothing is restarted on stale data",
            ),
        )
    judged_from = since + timedelta(seconds=deadline)
    if progress.scraped_at is None or progress.scraped_at < judged_from:
        # The newest count was read before the deadline ran out: the worker may have stepped
        # since. The poller wakes the job with the first scrape past it; if none comes, the
        # sample goes stale and Stalled says so (above).
        return Step(memory, requeue(max(1.0, (progress.fresh_until - now).total_seconds())))
    failure = Failure(
        "NoProgress",
        counted=True,
        action="replace",
        message=f"no training step for {int(idle)}s (failurePolicy.progressDeadlineSeconds is {deadline}): "
        f"{reporter.name if reporter else 'the reporting worker'}'s step count stayed at {progress.steps}",
    )
    return gang_restart(context, memory, current, [], store_lost=False, cause=failure)


def gang_restart(
    context: Context,
    memory: Memory,
    current: list[PodRecord],
    failures: list[tuple[PodRecord, Failure]],
    *,
    store_lost: bool,
    cause: Failure | None = None,
    shortfall: str | None = None,
) -> Step:
    """Record the failure and a new attempt (with backoff when counted), and stop the old gang.
    ``shortfall``: why too few train on, when not workers.min (replica groups say it in groups)."""
    spec = context.spec
    store = context.observed.store()
    failure = gang_cause(context, failures, store_lost=store_lost, cause=cause)
    lost = [pod for pod, _ in failures] + ([store] if store_lost and store is not None else [])
    memory = memory.counting(failure, lost)
    workload = context.observed.workload
    if workload is not None and workload.evicted:
        # Kueue took the quota back: in batch/v1 terms the job was suspended, so the
        # activeDeadlineSeconds clock starts again when the re-admitted gang trains.
        memory = replace(memory, start_time=None)
    if memory.restarts > spec.failure_policy.max_restarts:
        return finish(context, memory, "Failed", "RestartBudgetExhausted", budget_message(context, memory, failure))
    wait = backoff_seconds(spec.failure_policy, memory.restarts) if failure.counted else 0
    memory = memory.restarting_from(context.observed.progress, context.now)
    memory = replace(
        memory,
        attempt=memory.attempt + 1,
        restart_not_before=stored_time(context.now + timedelta(seconds=wait)) if wait else None,
    )
    # healthy pods stay and their supervisors restart the processes once moved to the new attempt:
    # at once when nothing is waited for (no backoff, no old store to see go), else by ``stages.held_back``
    kept = [pod for pod in current if context.keeps(pod, memory)]
    actions = context.removing([pod for pod in current if pod not in kept])
    if kept and not wait and not store_lost:
        actions += moving(context, kept, memory.attempt)
    if store_lost and store is not None:
        actions += context.removing([store])
    how = f"restarting the gang as attempt {memory.attempt}"
    if kept:
        how = f"restarting the gang in place as attempt {memory.attempt} ({len(kept)} of {len(current)} workers kept)"
    message = f"{failure.message}; fewer than min ({spec.workers.min}) workers remain, {how}"
    if shortfall is not None:
        message = f"{failure.message}; {shortfall}, {how}"
    elif store_lost or (cause is not None and spec.gang.scheduler != "kueue"):
        message = f"{failure.message}; {how}"
    elif spec.gang.scheduler == "kueue":
        message = f"{failure.message}; {how} (a new Kueue pod group)"
    if wait:
        message += f" after {wait}s"
        actions += requeue(float(wait))
    # a hang is named by its own reason: it is what the user must look into
    actions += event("Warning", "NoProgress" if failure.reason == "NoProgress" else "GangRestart", message)
    return Step(memory, actions, PhaseView("Restarting", failure.reason, message))


def moving(context: Context, pods: list[PodRecord], attempt: int) -> Actions:
    """Move pods a gang restart keeps to ``attempt``, with its rendezvous id."""
    rendezvous_id = naming.rendezvous_id(context.job.metadata.uid, attempt)
    return Actions(
        move=tuple(pod_patches.move(pod.name, pod.uid, pod.attempt or 0, attempt, rendezvous_id) for pod in pods)
    )


def gang_cause(
    context: Context, failures: list[tuple[PodRecord, Failure]], *, store_lost: bool, cause: Failure | None
) -> Failure:
    """The failure a gang restart is recorded as."""
    if cause is not None:
        return cause
    if failures:
        return failure_event(failures)
    if store_lost:
        return Failure(
            "RendezvousStoreLost", counted=False, action="replace", message="the rendezvous store pod was lost"
        )
    workload = context.observed.workload
    if workload is not None and workload.evicted:
        return Failure(  # Kueue deletes an evicted or preempted group's pods
            "Evicted",
            counted=False,
            action="replace",
            message=f"Kueue evicted Workload {workload.name} ({workload.evicted}); the gang is queued again",
        )
    return Failure(
        "WorkersDeleted", counted=False, action="replace", message="worker pods were deleted from outside the operator"
    )


def kueue_group_resized(context: Context, current: list[PodRecord]) -> Failure | None:
    """A Kueue pod group keeps the size it was admitted with: a new workers.desired needs a
    new group, so the gang restarts (not counted) as one of the new size."""
    if context.spec.gang.scheduler != "kueue":
        return None
    sizes = {pod.group_total for pod in current if pod.active and pod.group_total is not None}
    wanted = context.spec.workers.desired
    if not sizes or sizes == {wanted}:
        return None
    return Failure(
        "Rescaling",
        counted=False,
        action="replace",
        message=f"workers.desired is {wanted} and a Kueue pod group of {max(sizes)} cannot change its size",
    )


def budget_message(context: Context, memory: Memory, failure: Failure) -> str:
    return (
        f"{memory.restarts} counted failures exceed failurePolicy.maxRestarts "
        f"({context.spec.failure_policy.max_restarts}); last: {failure.message}"
    )


def failure_event(failures: list[tuple[PodRecord, Failure]]) -> Failure:
    """The one failure event the workers failed in one pass make: its first counted failure, else
    its first (``restartsByReason`` gets one entry per event, not per pod)."""
    counted = [failure for _, failure in failures if failure.counted]
    return counted[0] if counted else failures[0][1]


def worker_event_reason(reason: str) -> str:
    """The reason of the event for one replaced worker: Worker<Reason>, without doubling the prefix
    (WorkerFailed, not WorkerWorkerFailed)."""
    return reason if reason.startswith("Worker") else f"Worker{reason}"


def backoff_seconds(policy: api.FailurePolicy, counted_restarts: int) -> int:
    """Exponential backoff: backoffSeconds doubled per counted restart, capped."""
    if counted_restarts <= 0:
        return 0
    return int(min(policy.max_backoff_seconds, policy.backoff_seconds * 2 ** (counted_restarts - 1)))
