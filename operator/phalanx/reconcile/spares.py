"""Decisions about warm spares (``workers.spares``): which spare takes an empty slot, and which
spares to create, record as failed or remove.

A spare is a worker pod without a slot (``phalanx.dev/role: spare``) whose supervisor has done its
imports and waits. One JSON patch promotes it (role, slot, attempt, rendezvous id; a ``Move`` with
an index), after the status write that claims the slot for it (``slots``), and the kubelet hands
the new labels to the supervisor, which starts the command.
Workers lost while min survive make the world re-form in place as a new attempt, ready spares
taking the lost slots in that pass (``restarts.reform_in_place``); any other empty slot of the
current attempt is filled by a ready spare in the pass that finds it empty, before its old pod is
gone (``promotions``), and only when no spare is ready is a new worker pod created, as without
spares.

New spares are created only once every slot holds a scheduled worker, so a spare never takes the
place a worker of the gang needs. Spares join the PodGroup (as its members, not in ``minMember``)
and hold a worker's resources while they wait. A spare that fails is recorded once by UID in
``restartsByReason.SpareFailed`` (it trained nothing, so not against ``maxRestarts``) and removed;
once more spares failed than ``failurePolicy.maxRestarts``, no new one is created (a bad image or
node would otherwise be retried forever). Spares on nodes the job avoids or takes for lost are
removed, and spares beyond ``workers.spares`` go, newest first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.reconcile import desired, naming, slots
from phalanx.reconcile.actions import NOTHING, Actions, Move, event
from phalanx.reconcile.decision import Context, Memory
from phalanx.reconcile.environment import Launch
from phalanx.reconcile.failures import Failure, classify
from phalanx.reconcile.observed import PodRecord

Object = dict[str, Any]
SPARE_FAILED = "SpareFailed"
_SERIAL = re.compile(r"-spare-(\d+)$")


def serial(pod: PodRecord) -> int:
    """The number in a spare's name (spares are promoted oldest first)."""
    match = _SERIAL.search(pod.name)
    return int(match.group(1)) if match else 0


def ready_spares(context: Context, memory: Memory) -> list[PodRecord]:
    """Spares that may take a slot now: running, healthy, on a Ready node the job does not avoid
    (the pods a gang restart would keep, ``Context.keeps``), lowest serial first."""
    return sorted((pod for pod in context.observed.spares() if context.keeps(pod, memory)), key=serial)


def empty_slots(memory: Memory, current: Sequence[PodRecord], wanted: int) -> list[int]:
    """Slots below ``wanted`` that no active worker of the current attempt holds (a failed worker
    recorded this pass, or one being deleted, holds none)."""
    held = {pod.index for pod in current if pod.active and pod.index is not None and not memory.already_counted(pod)}
    return [index for index in range(wanted) if index not in held]


def promoting(context: Context, spare: PodRecord, index: int, attempt: int) -> Actions:
    """Move ``spare`` into slot ``index`` of ``attempt``, and say so."""
    rendezvous_id = naming.rendezvous_id(context.job.metadata.uid, attempt)
    move = Move(spare.name, spare.uid, spare.attempt or 0, attempt, rendezvous_id, index=index)
    return Actions(move=(move,)) + event(
        "Normal", "SparePromoted", f"spare {spare.name} takes worker slot {index} (attempt {attempt})"
    )


@dataclass(frozen=True)
class Promotions:
    """Which empty slots spares fill in this pass, and the slots left for new worker pods."""

    actions: Actions
    promoted: frozenset[str]
    """Names of the spares promoted."""
    unfilled: tuple[int, ...]


def promotions(context: Context, memory: Memory, current: Sequence[PodRecord]) -> Promotions:
    """Fill the empty slots of the current attempt with ready spares, lowest slot first. A slot
    whose claim waits for its spare (``slots.pending``) is that spare's: the same patch again."""
    claimed = slots.pending(context, memory)
    spares = [spare for spare in ready_spares(context, memory) if spare not in claimed.values()]
    actions = NOTHING
    promoted: set[str] = set()
    unfilled: list[int] = []
    for index, spare in claimed.items():
        promoted.add(spare.name)
        actions += promoting(context, spare, index, memory.attempt)
    for index in empty_slots(memory, current, context.spec.workers.desired):
        if index in claimed:
            continue
        if not spares:
            unfilled.append(index)
            continue
        spare = spares.pop(0)
        promoted.add(spare.name)
        actions += promoting(context, spare, index, memory.attempt)
    return Promotions(actions, frozenset(promoted), tuple(unfilled))


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
    current: Sequence[PodRecord],
    *,
    promoted: frozenset[str],
    may_create: bool,
) -> SpareUpkeep:
    """Record failed spares once and remove them, remove spares on lost or avoided nodes and those
    beyond ``workers.spares``, and (``may_create``: no worker pod is being created) create the
    missing ones once every slot holds a scheduled worker."""
    job, spec = context.job, context.spec
    actions = NOTHING
    kept: list[PodRecord] = []
    for pod in context.observed.spares():
        if pod.name in promoted or pod.deleting:
            continue
        if pod.finished:
            if not memory.already_counted(pod):
                why = classify(pod, node_lost=context.node_lost(pod))
                message = f"spare {pod.name} ended ({pod.phase}, exit code {pod.exit_code})"
                if why is not None:
                    message += f": {why.message}"
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
    workers_placed = may_create and all(pod.scheduled for pod in current if pod.active)
    if missing <= 0 or not workers_placed or failed > spec.failure_policy.max_restarts:
        return SpareUpkeep(memory, actions=actions)
    names = {pod.name for pod in context.observed.pods}
    serials = (n for n in range(len(names) + wanted + 1) if naming.spare_pod_name(job.metadata.name, n) not in names)
    create = tuple(
        desired.spare_pod(
            job, launch, serial=next(serials), attempt=memory.attempt, avoid=memory.avoided_nodes, domain=memory.domain
        )
        for _ in range(missing)
    )
    return SpareUpkeep(memory, create, actions)
