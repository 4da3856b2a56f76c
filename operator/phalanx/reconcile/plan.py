"""The planner: TrainingJob + observed children + now -> changes, events and the next status.

It does no I/O and reads no clock: ``now`` is an argument. Everything the job must remember
between passes (the attempt, the restart budget, the backoff deadline, start and completion
times) lives in ``status``, so the operator can restart at any moment, and deleting children
never resets a budget. Planning against the result of its own plan yields no change.

A pass is three steps: ``decide.decide`` makes every decision as values (the phase, the failures
to count, the restart, the slots to fill, what may be created now); this module renders those into
a ``Plan`` (objects to apply, deletions, Events) and the next status, from the decision and the
previous status. ``docs/architecture.md`` tells the whole flow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming, replica_groups, slots
from phalanx.reconcile.actions import NOTHING, Deletion, Event
from phalanx.reconcile.decide import decide
from phalanx.reconcile.goodput import notice_savings, time_by_state
from phalanx.reconcile.observed import Observed
from phalanx.reconcile.pass_values import Context, Decision, Memory, concluded, finish
from phalanx.reconcile.pod_patches import PodPatch
from phalanx.reconcile.preemption_cost import WorkloadBoost, preemption_cost
from phalanx.reconcile.save_now import save_now
from phalanx.reconcile.status import TRAINING, PhaseView, conditions, format_optional_time, format_time, parse_time
from phalanx.reconcile.training_progress import last_written as last_progress_write
from phalanx.reconcile.training_progress import training_progress

Object = dict[str, Any]


@dataclass(frozen=True)
class Plan:
    """What one reconcile pass should do."""

    apply: tuple[Object, ...] = ()
    delete: tuple[Deletion, ...] = ()
    move: tuple[PodPatch, ...] = ()
    address: tuple[PodPatch, ...] = ()
    status: dict[str, Any] = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None
    delete_job: bool = False
    rescaled: Literal["up", "down"] | None = None
    boost: WorkloadBoost | None = None
    """The Kueue Workload's priority boost to set (``reconcile.preemption_cost``), after status."""
    notices: tuple[PodPatch, ...] = ()
    """A pending save-now token carried onto running workers (``reconcile.save_now``), after status."""

    @property
    def promotes(self) -> bool:
        """Whether the plan promotes a spare: its status write, which records the slot claim
        (``slots``), must go first and pass its resourceVersion precondition, changed or not."""
        return any(move.promotes_slot is not None for move in self.move)

    @property
    def changes_children(self) -> bool:
        """Whether the plan creates, changes or deletes anything besides status."""
        return bool(
            self.apply or self.delete or self.move or self.address or self.notices or self.delete_job or self.boost
        )


def render(job: api.TrainingJob, observed: Observed, now: datetime, decision: Decision) -> Plan:
    """The plan and the next status for ``decision``; the Events that follow from the status (a
    new stall, a phase change, a TTL under GitOps) are added here."""
    memory, view, stall = decision.memory, decision.view, decision.stall
    previous = job.status
    deletions = tuple(dict.fromkeys(decision.actions.delete))
    events = list(decision.actions.events)
    attempt_workers = [pod for pod in observed.workers() if pod.attempt == memory.attempt]
    deleted = {deletion.name for deletion in deletions if deletion.kind == "Pod"}
    still_active = [pod for pod in attempt_workers if pod.active and pod.name not in deleted]
    ready = sum(1 for pod in still_active if pod.ready)
    wanted = job.spec.workers.desired
    leaving = deleted | {move.name for move in decision.actions.move if move.promotes_slot is not None}  # promoted
    spares_ready = sum(
        1 for pod in observed.spares() if pod.active and pod.phase == "Running" and pod.name not in leaving
    )
    stalled_before = next((c for c in previous.conditions or [] if c.type == "Stalled"), None)
    if stall is not None and (
        stalled_before is None or stalled_before.status != "True" or stalled_before.reason != stall[0]
    ):
        events.append(Event("Warning", *stall))
    if view.phase != previous.phase and not events:
        troubled = view.phase in ("Failed", "Restarting") or stall is not None
        kind: Literal["Normal", "Warning"] = "Warning" if troubled else "Normal"
        events.append(Event(kind, view.reason, f"{previous.phase or 'New'} -> {view.phase}: {view.message}"))
    tool = job.metadata.gitops_tool()
    if previous.phase is None and tool is not None and job.spec.ttl_seconds_after_finished is not None:
        events.append(
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
        "restartsByReason": dict(memory.by_reason),
        # pruned to pods that still exist: a UID never comes back once its pod is gone
        "countedFailures": sorted(memory.counted & {pod.uid for pod in observed.pods}) or None,
        "removedWorkers": sorted(memory.removed & {pod.uid for pod in observed.pods}) or None,
        "workers": {
            "desired": wanted,
            "active": len(still_active),
            "ready": ready,
        },
        "replicas": len(still_active),
        "selector": naming.worker_selector(job.metadata.name),
        "workerSummary": f"{ready}/{wanted}" + (f" +{spares_ready} spare" if job.spec.workers.spares else ""),
        "conditions": conditions(
            previous.conditions, view, generation=job.metadata.generation, now=now, stalled_override=stall
        ),
        "trainingSeconds": training_seconds(previous, view, now),
    }
    if memory.recomputed or memory.reached is not None or previous.recomputed_steps is not None:
        status["recomputedSteps"] = {
            "total": memory.recomputed,
            "reached": memory.reached,
            "failedAt": format_optional_time(memory.failed_at),
        }
    # a job an older operator ran begins to be counted now: its earlier time is not known by state
    began = job.metadata.creation_timestamp if previous.phase is None else None
    spent = time_by_state(previous.time_by_state, view, began, now)
    if spent is not None:  # unchanged: left out, as None would remove it
        status["timeByState"] = spent
    worker_fields, checkpoint = progress_status(previous, observed, memory, view)
    status["workers"].update(worker_fields)
    if job.spec.workers.spares:
        status["workers"]["spares"] = spares_ready
    if checkpoint is not None:
        status["lastCheckpoint"] = checkpoint
    newest = api.LastCheckpoint.model_validate(checkpoint) if checkpoint is not None else previous.last_checkpoint
    reported = observed.progress  # what its workers say the newest checkpoint answers, when it is theirs
    answers = reported.checkpoint_save_now if reported and newest and reported.checkpoint_step == newest.step else None
    request, notices = save_now(
        job, previous, newest, observed.pods, attempt=memory.attempt, phase=view.phase, now=now, answers=answers
    )
    if request is not None:  # else the one there stands (a merge patch keeps it)
        status["saveNow"] = request
    savings = notice_savings(previous, memory, observed.progress, gpus_per_worker=job.spec.gpus.count, now=now)
    if savings is not None:  # else the one there stands
        status["noticeSavings"] = savings
    progress, progress_due = training_progress(
        previous, observed.reported, job_uid=job.metadata.uid, phase=view.phase, now=now
    )
    if progress is not None:  # None: the one there stands (a merge patch keeps it)
        status["progress"] = progress
    cost = preemption_cost(
        previous,
        view.phase,
        workers=len(still_active),
        gpus_per_worker=job.spec.gpus.count,
        workload=observed.workload,
        progress_written=progress is not None,
        progress_time=last_progress_write(previous),
        now=now,
        checkpoint=newest if checkpoint is not None else None,
    )
    if decision.restart_mode is not None:
        status["restartMode"] = decision.restart_mode
    status["startTime"] = format_optional_time(memory.start_time)
    status["completionTime"] = format_optional_time(memory.completion_time)
    status["restartNotBefore"] = format_optional_time(memory.restart_not_before)
    topology = job.spec.placement.topology if job.spec.placement else None
    status["placement"] = {"key": topology.key, "domain": memory.domain} if topology is not None else None
    status["slotClaims"] = slots.recorded(memory, decision.actions.move)
    if job.spec.replica_groups is not None:
        status["replicaGroups"] = replica_groups.status_entries(
            job.spec, memory, observed.workers(), observed.node_labels
        )
    status["avoidedNodes"] = [
        {"node": entry.node, "reason": entry.reason, "message": entry.message, "until": format_time(entry.until)}
        for entry in memory.avoided
    ] or None
    # else the one there stands (a merge patch keeps it); None removes it. A refresh that acts on
    # nothing rides a write made anyway: a steady job that reports nothing is not written for it
    if cost.write and not (cost.rides and not status_changed(previous, status)):
        status["preemptionCost"] = cost.value
    due = [wait for wait in (progress_due, cost.due) if wait is not None]
    requeue = [*decision.actions.requeue, *due]
    return Plan(
        apply=decision.apply,
        delete=deletions,
        move=tuple(dict.fromkeys(decision.actions.move)),
        address=tuple(dict.fromkeys(decision.actions.address)),
        notices=notices,
        status=status,
        events=tuple(events),
        requeue_after=min(requeue) if requeue else None,
        delete_job=decision.delete_job,
        rescaled=decision.rescaled,
        boost=cost.boost,
    )


def training_seconds(previous: api.TrainingJobStatus, view: PhaseView, now: datetime) -> int:
    """Seconds spent training (Running or Rescaling) up to the last time the job left training.

    Together with the Running condition's lastTransitionTime this gives goodput without a
    clock in the operator's memory, so it survives operator restarts.
    """
    total = previous.training_seconds
    if previous.phase in TRAINING and view.phase not in TRAINING:
        running = next((c for c in previous.conditions or [] if c.type == "Running"), None)
        since = parse_time(running.last_transition_time) if running is not None else None
        if since is not None:
            total += max(0, int((now - since).total_seconds()))
    return total


def progress_status(
    previous: api.TrainingJobStatus, observed: Observed, memory: Memory, view: PhaseView
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """From what a worker reported: the fields for ``status.workers`` (the world size, shown only
    while the current attempt trains) and a newer ``lastCheckpoint`` (None: keep the one there)."""
    workers: dict[str, Any] = {}
    progress = observed.progress
    current = progress if progress is not None and progress.attempt == memory.attempt else None
    if current is not None and current.world_size and view.phase in TRAINING:
        workers["worldSize"] = current.world_size
    elif previous.workers is not None and previous.workers.world_size is not None:
        workers["worldSize"] = None  # merge patch: remove it
    if progress is None or progress.checkpoint_step is None or progress.checkpoint_time is None:
        return workers, None
    last = previous.last_checkpoint
    step, committed = progress.checkpoint_step, format_time(progress.checkpoint_time)
    # RFC 3339 UTC strings order as times; an older report (a lagging worker) never wins
    if last is None or (committed >= last.time and (last.step, last.time) != (step, committed)):
        return workers, {"step": step, "time": committed}
    return workers, None


def plan(job: api.TrainingJob, observed: Observed, now: datetime) -> Plan:
    """Plan one reconcile pass. Never raises for a bad spec: that becomes a Failed job."""
    if job.metadata.deletion_timestamp is not None:
        return Plan()
    return render(job, observed, now, decide(job, observed, now))


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
PROGRESS_KEYS = frozenset(
    {
        "message",
        "workers",
        "replicas",
        "workerSummary",
        "trainingSeconds",
        "lastCheckpoint",
        "progress",
        "preemptionCost",
    }
)


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
        if key == "removedWorkers" and set(value or ()) <= set(current.get(key) or ()):
            continue  # only UIDs of pods gone since: never reused, so dropping them can wait
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
    context = Context(job, observed, now)
    decision = concluded(NOTHING, finish(context, Memory.of(job.status), "Failed", reason, message))
    return render(job, observed, now, decision)


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
