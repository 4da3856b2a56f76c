"""Decisions about warm spares (``workers.spares``): which spare takes an empty slot, and which
spares to create, record as failed or remove.

A spare is a worker pod without a slot (``phalanx.dev/role: spare``) whose supervisor has done its
imports and waits. One JSON patch promotes it (role, slot, attempt, rendezvous id;
``pod_patches.promotion``), after the status write that claims the slot for it (``slots``), and the kubelet hands
the new labels to the supervisor, which starts the command.
Workers lost while min survive make the world re-form in place as a new attempt, ready spares
taking the lost slots below ``workers.desired`` in that pass (``restarts.reform_in_place``; a slot
a scale-down removes in the same pass is none of them); any other empty slot of the current attempt
is filled by a ready spare in the pass that finds it empty, before its old pod is gone
(``promotions``), and only when no spare is ready is a new worker pod created, as without spares.
A worker that waits for a node (not bound to one) gives its slot to a ready spare, and is deleted.

New spares are created only once every slot holds a worker bound to a node, so a spare never
takes the place a worker of the gang needs; they rank below the workers (``desired.spare_pod``:
the operator's spare PriorityClass). Spares join the PodGroup (as its members, not in
``minMember``) and hold a worker's resources while they wait. A spare that fails of its own accord
(``own_failure``: its container failed, or cannot start) is recorded once by UID in
``restartsByReason.SpareFailed`` (it trained nothing, so not against ``maxRestarts``) and removed;
once more spares failed than ``failurePolicy.maxRestarts``, no new one is created (a bad image
or node would otherwise be retried forever). A spare stopped for another cause (evicted, preempted,
its node shut down or lost) is removed and replaced, unrecorded. Spares on nodes the job avoids or
takes for lost are removed, and spares beyond ``workers.spares`` go, newest first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.reconcile import desired, naming, pod_patches, replica_groups, slots
from phalanx.reconcile.actions import NOTHING, Actions, event
from phalanx.reconcile.environment import Launch
from phalanx.reconcile.failures import Failure, classify
from phalanx.reconcile.observed import PodRecord
from phalanx.reconcile.pass_values import Context, Memory

Object = dict[str, Any]
SPARE_FAILED = "SpareFailed"
_SERIAL = re.compile(r"-spare-(\d+)$")


def own_failure(why: Failure) -> bool:
    """Whether a spare stopped through a fault of its own, which spends the spares' budget: its
    container failed as a worker's failure would be counted (an error, an OOM kill), or cannot start
    (an image that cannot be pulled, a bad configuration). An eviction, a preemption, a node shut
    down, lost or refusing it, or a SIGTERM it ended on (exit 0) is not its fault."""
    return why.counted or why.action == "fail"


def serial(pod: PodRecord) -> int:
    """The number in a spare's name (spares are promoted oldest first)."""
    match = _SERIAL.search(pod.name)
    return int(match.group(1)) if match else 0


def ready_spares(context: Context, memory: Memory) -> list[PodRecord]:
    """Spares that may take a slot now: running, healthy, on a Ready node the job does not avoid
    (``Context.fit``, as the pods a gang restart keeps), lowest serial first."""
    return sorted((pod for pod in context.observed.spares() if context.fit(pod, memory)), key=serial)


def empty_slots(memory: Memory, current: Sequence[PodRecord], wanted: int) -> list[int]:
    """Slots below ``wanted`` that no active worker of the current attempt holds (a failed worker
    recorded this pass, or one being deleted, holds none)."""
    held = {pod.index for pod in holders(memory, current)}
    return [index for index in range(wanted) if index not in held]


def holders(memory: Memory, current: Sequence[PodRecord]) -> list[PodRecord]:
    """The active workers of the current attempt that hold a slot (none recorded as failed)."""
    return [pod for pod in current if pod.active and pod.index is not None and not memory.already_counted(pod)]


def waiting_slots(memory: Memory, current: Sequence[PodRecord], wanted: int) -> list[PodRecord]:
    """Workers below ``wanted`` not bound to a node, alone in their slot: a ready spare may take it
    (a doubled slot was resolved before, ``slots.one_pod_per_slot``)."""
    return [pod for pod in holders(memory, current) if pod.node_name is None and (pod.index or 0) < wanted]


def promoting(context: Context, memory: Memory, spare: PodRecord, index: int) -> Actions:
    """Move ``spare`` into slot ``index`` of the current attempt, and say so. With replica groups it
    joins the slot's group at the group's generation: that world's rendezvous id and labels."""
    uid, attempt = context.job.metadata.uid, memory.attempt
    group = replica_groups.group_of(context.spec, index)
    if group is None:
        rendezvous_id, joins, grouped = naming.rendezvous_id(uid, attempt), None, ""
    else:
        generation = replica_groups.generation(memory, group)
        rendezvous_id = naming.group_rendezvous_id(uid, attempt, group, generation)
        joins, grouped = (group, generation), f", replica group {group} generation {generation}"
    move = pod_patches.promotion(spare.name, spare.uid, spare.attempt or 0, attempt, rendezvous_id, index, joins)
    return Actions(move=(move,)) + event(
        "Normal", "SparePromoted", f"spare {spare.name} takes worker slot {index} (attempt {attempt}{grouped})"
    )


@dataclass(frozen=True)
class Promotions:
    """Which slots spares fill in this pass, and the slots left for new worker pods."""

    actions: Actions
    """The promotions, and the deletion of the unbound workers whose slots spares took."""
    promoted: frozenset[str]
    """Names of the spares promoted."""
    unfilled: tuple[int, ...]
    placed: bool
    """Every slot holds a worker bound to a node once this pass's promotions are done: only then
    may a new spare be created (it would otherwise compete with a worker for a node)."""


def promotions(context: Context, memory: Memory, current: Sequence[PodRecord]) -> Promotions:
    """Fill the empty slots of the current attempt with ready spares, lowest slot first, then the
    slots whose worker waits for a node: a ready spare runs already (it may hold the very room the
    worker waits for), so it takes the slot and the waiting pod is deleted. A slot whose claim waits
    for its spare (``slots.pending``) is that spare's: the same patch again. The promotion is claimed
    in status and sent before the deletion (``apply``), so a pass cut short between the two leaves
    a doubled slot, whose unbound pod the next pass deletes (``slots.one_pod_per_slot``); the
    waiting pod never ran, so its deletion is no loss (``status.removedWorkers``)."""
    claimed = slots.pending(context, memory)
    spares = [spare for spare in ready_spares(context, memory) if spare not in claimed.values()]
    wanted = context.spec.workers.desired
    actions = NOTHING
    promoted: set[str] = set()
    unfilled: list[int] = []
    for index, spare in claimed.items():
        promoted.add(spare.name)
        actions += promoting(context, memory, spare, index)
    for index in empty_slots(memory, current, wanted):
        if index in claimed:
            continue
        if not spares:
            unfilled.append(index)
            continue
        spare = spares.pop(0)
        promoted.add(spare.name)
        actions += promoting(context, memory, spare, index)
    still_waiting = 0
    for pod in sorted(waiting_slots(memory, current, wanted), key=lambda pod: pod.index or 0):
        if pod.index in claimed:  # its claimed spare's patch goes again above
            actions += context.removing([pod])
            continue
        if not spares:
            still_waiting += 1
            continue
        spare = spares.pop(0)
        promoted.add(spare.name)
        actions += promoting(context, memory, spare, pod.index or 0) + context.removing([pod])
    placed = not unfilled and not still_waiting
    return Promotions(actions, frozenset(promoted), tuple(unfilled), placed)


@dataclass(frozen=True)
class SpareUpkeep:
    """What tending the spares decided: the memory (failed spares recorded), spares to create, and
    removals and Events."""

    memory: Memory
    create: tuple[Object, ...] = ()
    actions: Actions = NOTHING


def upkeep(
    context: Context,
    memory: Memory,
    launch: Launch,
    *,
    promoted: frozenset[str],
    may_create: bool,
) -> SpareUpkeep:
    """Record spares that failed of their own accord once and remove them, remove those stopped
    for another cause, on lost or avoided nodes and beyond ``workers.spares``, and (``may_create``:
    every slot holds a worker bound to a node, ``Promotions.placed``) create the missing ones."""
    job, spec = context.job, context.spec
    actions = NOTHING
    kept: list[PodRecord] = []
    for pod in context.observed.spares():
        if pod.name in promoted or pod.deleting:
            continue
        why = classify(pod, node_lost=context.node_lost(pod))
        if pod.finished or (why is not None and why.action == "fail"):
            if why is not None and own_failure(why) and not memory.already_counted(pod):
                message = f"spare {pod.name} ended ({pod.phase}, exit code {pod.exit_code}): {why.message}"
                if not pod.finished:
                    message = f"spare {pod.name} failed: {why.message}"
                memory = memory.counting(Failure(SPARE_FAILED, counted=False, action="replace", message=message), [pod])
                actions += event("Warning", SPARE_FAILED, message + "; a new spare replaces it")
            actions += context.removing([pod])
        elif (
            context.node_lost(pod) is not None
            or (pod.node_name is not None and pod.node_name in memory.avoided_nodes)
            or pod.disruption_reason is not None
        ):
            actions += context.removing([pod])
        else:
            kept.append(pod)
    wanted = spec.workers.spares
    extra = sorted(kept, key=serial)[wanted:]
    actions += context.removing(sorted(extra, key=serial, reverse=True))
    missing = wanted - (len(kept) - len(extra))
    failed = dict(memory.by_reason).get(SPARE_FAILED, 0)
    if missing <= 0 or not may_create or failed > spec.failure_policy.max_restarts:
        return SpareUpkeep(memory, actions=actions)
    names = {pod.name for pod in context.observed.pods}
    serials = (n for n in range(len(names) + wanted + 1) if naming.spare_pod_name(job.metadata.name, n) not in names)
    create = tuple(
        desired.spare_pod(
            job,
            launch,
            serial=next(serials),
            attempt=memory.attempt,
            avoid=context.avoided_nodes(memory),
            domain=memory.domain,
            priority_class=context.observed.spare_priority_class,
        )
        for _ in range(missing)
    )
    return SpareUpkeep(memory, create, actions)
