"""Decisions of a job that is not held back: which worker slots to fill and what to remove when
desired changes, then the phase from the workers' progress, and ``Stalled`` when children could
not be created or what the job waits for can never come."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, Literal

from phalanx.reconcile import capacity, desired, naming, replica_groups, spares
from phalanx.reconcile.actions import Actions, event
from phalanx.reconcile.environment import Launch
from phalanx.reconcile.observed import PodRecord
from phalanx.reconcile.pass_values import Context, Memory, Stall, Step
from phalanx.reconcile.status import TRAINING, PhaseView, format_time, stored_time

Object = dict[str, Any]


@dataclass(frozen=True)
class Scaling:
    """What the worker slots need: pods to create, spares promoted, the surplus removed."""

    slots: list[Object]
    """New worker pods for empty slots no spare fills, lowest index first."""
    actions: Actions
    """Spares promoted, the surplus removed (highest index first), a Rescaling Event."""
    promoted: frozenset[str]
    placed: bool
    """Every slot holds a worker bound to a node (``spares.Promotions.placed``)."""
    rescaled: Literal["up", "down"] | None


def scaling(context: Context, memory: Memory, launch: Launch, current: list[PodRecord]) -> Scaling:
    """Fill the empty slots below desired (with ready spares first, ``spares.promotions``), remove
    the surplus, and say whether desired changed since the last pass. A new pod of a slot waits
    until the slot's old pod (of any attempt) is gone, since it takes its name."""
    job, spec = context.job, context.spec
    wanted = spec.workers.desired
    kueue_total: int | None = None
    if spec.gang.scheduler == "kueue":
        totals = {pod.group_total for pod in current if pod.group_total is not None}
        kueue_total = totals.pop() if len(totals) == 1 else wanted
    taken = {pod.name for pod in context.observed.workers()}
    filled = spares.promotions(context, memory, current)
    slots = [
        desired.worker_pod(
            job,
            launch,
            index=index,
            attempt=memory.attempt,
            kueue_total=kueue_total,
            avoid=context.avoided_nodes(memory),
            domain=memory.domain,
            group_generation=replica_groups.slot_generation(spec, memory, index),
        )
        for index in filled.unfilled
        if naming.worker_pod_name(job.metadata.name, index) not in taken
    ]
    surplus = sorted(
        (pod for pod in current if pod.active and pod.index is not None and pod.index >= wanted),
        key=lambda pod: -(pod.index or 0),
    )
    actions = filled.actions + context.removing(surplus)
    before = job.status.workers.desired if job.status.workers else None
    rescaled: Literal["up", "down"] | None = None
    if before and before != wanted:
        rescaled = "up" if wanted > before else "down"
        actions += event("Normal", "Rescaling", f"desired workers changed from {before} to {wanted}")
    return Scaling(slots, actions, filled.promoted, filled.placed, rescaled)


def running_phase(
    context: Context,
    memory: Memory,
    launch: Launch,
    current: list[PodRecord],
    store: PodRecord | None,
    blocked: tuple[Stall, ...],
) -> Step:
    """The phase of a job that is not held back, and ``Stalled`` when children could not be
    created or what it waits for can never come."""
    step = progress_phase(context, memory, current, store)
    view = step.view
    assert view is not None
    if not blocked:
        return beyond_capacity(context, launch, step, current)
    # Children we could not create: say why, and whether the job can train at all.
    reason, first = blocked[0]
    message = first if len(blocked) == 1 else f"{first} (and {len(blocked) - 1} more)"
    active = sum(1 for pod in current if pod.active)
    minimum = context.spec.workers.min
    if view.phase not in TRAINING and active < minimum:
        message += (
            f"; the job holds {active} of the {minimum} worker(s) it needs (workers.min) "
            "and cannot train until the rest can be created"
        )
    else:
        message = f"{view.message}; {message}"
    return replace(step, view=PhaseView(view.phase, reason, message), stall=(reason, message))


def progress_phase(context: Context, memory: Memory, current: list[PodRecord], store: PodRecord | None) -> Step:
    """Pending, Starting, Running or Rescaling, from the workers and the store (``startTime`` is
    remembered the first time enough workers are ready)."""
    spec, previous = context.spec, context.job.status
    minimum, wanted = spec.workers.min, spec.workers.desired
    active = [pod for pod in current if pod.active]
    ready = [pod for pod in active if pod.ready]
    finishing = [pod for pod in active if pod.exit_code == 0 and pod.disruption_reason is None]
    if finishing:
        # A worker's container exited 0 and the kubelet has yet to mark its pod Succeeded, or its
        # peers are still shutting down: training is ending, not starting again.
        others = len(active) - len(finishing)
        return Step(
            memory,
            view=PhaseView(
                previous.phase if previous.phase in TRAINING else "Running",
                "Completing",
                f"{finishing[0].name} finished training; waiting for {others} other worker(s) to finish",
            ),
        )
    if len(ready) >= minimum and store is not None and store.ready:
        if memory.start_time is None:
            memory = replace(memory, start_time=stored_time(context.now))
        if len(active) == wanted and len(ready) == wanted:
            return Step(memory, view=PhaseView("Running", "WorkersReady", f"{len(ready)} worker(s) training"))
        return Step(
            memory, view=PhaseView("Rescaling", "Rescaling", f"{len(ready)} worker(s) training, converging to {wanted}")
        )
    workload = context.observed.workload
    if workload is not None and not workload.admitted and active:
        why = f": {workload.message}" if workload.message else ""
        return Step(
            memory,
            view=PhaseView(
                "Pending",
                "Queued",
                f"Kueue holds the gang in LocalQueue {spec.gang.queue} (Workload {workload.name}){why}",
            ),
        )
    if any(pod.scheduled for pod in active):
        return Step(
            memory, view=PhaseView("Starting", "WorkersStarting", f"{len(ready)} of at least {minimum} worker(s) ready")
        )
    unschedulable = next((pod.unschedulable_message for pod in active if pod.unschedulable_message), None)
    if unschedulable:
        return Step(memory, view=PhaseView("Pending", "Unschedulable", unschedulable))
    return Step(memory, view=PhaseView("Pending", "WorkersPending", f"waiting for {minimum} worker(s) to be scheduled"))


def beyond_capacity(context: Context, launch: Launch, step: Step, current: list[PodRecord]) -> Step:
    """Stalled when what the job waits for can never come: more workers than the schedulable
    nodes can hold, or a gang larger than its Kueue queue's whole quota. It clears by itself
    when nodes (or quota) grow."""
    view = step.view
    assert view is not None
    if view.phase not in ("Pending", "Rescaling"):
        return step
    workload = context.observed.workload
    if view.reason == "Queued" and workload is not None and "maximum capacity" in (workload.message or ""):
        stall = ("ExceedsQueueCapacity", f"{view.message}; it can never be admitted as it is")
        return replace(step, view=PhaseView(view.phase, *stall), stall=stall)
    if not any(pod.unschedulable_message for pod in current if pod.active):
        return step  # the scheduler has not given up on any worker
    per_worker = desired.worker_demand(context.job, launch)
    nodes = context.observed.node_allocatable
    why = capacity.shortfall(per_worker, tuple(nodes.values()), context.spec.workers.desired)
    if why is not None:
        return replace(
            step,
            view=PhaseView(view.phase, "InsufficientCapacity", f"{view.message}; {why}"),
            stall=("InsufficientCapacity", why),
        )
    return kept_off(context, step, per_worker)


def kept_off(context: Context, step: Step, per_worker: Mapping[str, Decimal]) -> Step:
    """A job that waits for nodes while it keeps off some (failurePolicy.avoidNodeSeconds) says so;
    Stalled (NodesAvoided) when the other schedulable nodes cannot hold workers.min of its workers.
    It clears when the avoidance ends or nodes are added."""
    view, avoided = step.view, step.memory.avoided
    if view is None or not avoided:
        return step
    names = ", ".join(f"{entry.node} ({entry.reason})" for entry in avoided)
    ends = format_time(min(entry.until for entry in avoided))
    note = f"this job keeps off {len(avoided)} node(s) after failures until {ends} at the earliest: {names}"
    nodes = context.observed.node_allocatable
    minimum = context.spec.workers.min
    usable = tuple(offer for name, offer in nodes.items() if name not in step.memory.avoided_nodes)
    fits = capacity.workers_that_fit(per_worker, usable) if nodes else -1
    if 0 <= fits < minimum:
        message = (
            f"{note}; the other {len(usable)} schedulable node(s) can hold {fits} of the {minimum} worker(s) "
            "it needs (workers.min)"
        )
        return replace(
            step,
            view=PhaseView(view.phase, "NodesAvoided", f"{view.message}; {message}"),
            stall=("NodesAvoided", message),
        )
    return replace(step, view=PhaseView(view.phase, view.reason, f"{view.message}; {note}"))
