"""Replica groups that fail alone (spec.replicaGroups).

The workers are split into data-parallel groups of ``size``: group g holds slots g*size ..
g*size+size-1, and each group is a torchrun world of its own (``naming.group_rendezvous_id``).
A worker of group g that fails, or is deleted from outside, restarts group g alone: the group's
generation goes up (status.replicaGroups, written before anything is deleted), every pod of the
group goes, and its slots are filled again by pods of the new generation, which form a new world
and take the weights from a healthy peer group (``phalanx.worker.replica_groups``). The other
groups' pods are left running. Each group restart is one failure event: counted once against
failurePolicy.maxRestarts when its failure counts (however many of the group's workers failed),
and the UIDs of its failed pods are recorded so a later pass never counts them again.

The groups restart alone only while at least replicaGroups.min groups train on (``training_on``:
not hit by this pass's failures, every worker of their generation running and Ready, so that the
group holds the weights). Below ``min`` the whole gang restarts from the latest checkpoint
(``restarts.gang_restart``: one failure event, counted as any gang restart, and the job fails when
failurePolicy.maxRestarts is spent), as a job without groups does below workers.min. Since
``min`` is at least 1 this also covers the case where no group is left to heal the others from:
a returning group heals from a peer's weights, never from storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile.actions import NOTHING, event
from phalanx.reconcile.failures import Failure
from phalanx.reconcile.observed import PodRecord
from phalanx.reconcile.pass_values import Context, GroupState, Memory, Step, finish


def group_of(spec: api.TrainingJobSpec, index: int | None) -> int | None:
    """The replica group of worker slot ``index`` (None: no groups, or no slot)."""
    if spec.replica_groups is None or index is None:
        return None
    return index // spec.replica_groups.size


def group_count(spec: api.TrainingJobSpec) -> int:
    """The groups workers.desired makes (0 without replicaGroups)."""
    return 0 if spec.replica_groups is None else spec.workers.desired // spec.replica_groups.size


def generation(memory: Memory, group: int) -> int:
    """The group's generation: how often it was restarted alone."""
    return next((state.generation for state in memory.groups if state.index == group), 0)


def restarted(memory: Memory, group: int) -> Memory:
    """``group`` restarted alone: its generation and restarts one higher."""
    held = {state.index: state for state in memory.groups}
    old = held.get(group, GroupState(group))
    held[group] = replace(old, generation=old.generation + 1, restarts=old.restarts + 1)
    return replace(memory, groups=tuple(held[index] for index in sorted(held)))


def stale_generations(context: Context, memory: Memory, current: Iterable[PodRecord]) -> list[PodRecord]:
    """Pods of a group generation older than the recorded one: a pass stopped between the status
    write that restarted their group and their deletion left them. They go, and whatever they do
    meanwhile (a peer's exit as its world broke up) is no new failure."""
    spec = context.spec
    return [
        pod
        for pod in current
        if (group := group_of(spec, pod.index)) is not None and (pod.group_generation or 0) < generation(memory, group)
    ]


def restart_groups(
    context: Context,
    memory: Memory,
    current: list[PodRecord],
    failures: list[tuple[PodRecord, Failure]],
    deleted: list[PodRecord],
) -> Step | None:
    """Restart only the groups whose workers failed or were deleted; None when fewer than
    replicaGroups.min groups would train on (the gang restarts as a whole instead)."""
    spec = context.spec
    total = group_count(spec)
    lost = [pod for pod, _ in failures] + deleted
    hit = hit_groups(spec, lost)
    going_on = training_on(spec, memory, current, hit)
    if spec.replica_groups is None or len(going_on) < spec.replica_groups.min:
        return None
    actions = NOTHING
    for group in hit:
        ours = [(pod, failure) for pod, failure in failures if group_of(spec, pod.index) == group]
        failure = _group_failure(ours)
        memory = restarted(memory.counting(failure, (pod for pod, _ in ours)), group)
        members = [pod for pod in current if group_of(spec, pod.index) == group and (pod.active or pod in lost)]
        actions += context.removing(members)
        actions += event(
            "Warning",
            "ReplicaGroupRestart",
            f"{failure.message}; restarting replica group {group} alone as generation "
            f"{generation(memory, group)}, {len(going_on)} of {total} group(s) train on",
        )
    if memory.restarts > spec.failure_policy.max_restarts:
        exhausted = finish(
            context,
            memory,
            "Failed",
            "RestartBudgetExhausted",
            f"{memory.restarts} counted failures exceed failurePolicy.maxRestarts "
            f"({spec.failure_policy.max_restarts}); last: a failure in replica group {hit[-1]}",
        )
        return replace(exhausted, actions=actions + exhausted.actions)
    return Step(memory, actions)


def hit_groups(spec: api.TrainingJobSpec, lost: Iterable[PodRecord]) -> list[int]:
    """The groups (of those workers.desired makes) that the failed or deleted pods ``lost`` belong to."""
    total = group_count(spec)
    return sorted({group for pod in lost if (group := group_of(spec, pod.index)) is not None and group < total})


def training_on(spec: api.TrainingJobSpec, memory: Memory, current: Iterable[PodRecord], hit: list[int]) -> list[int]:
    """The groups that train on past this pass: not ``hit``, with an active worker of the group's
    current generation and attempt in every slot, and those all Ready. A group not yet Ready holds
    no weights to heal another from (it is coming back, or was added by a scale-up, and heals from
    a peer itself), except while the attempt starts: until any worker of it is Ready, the groups
    start together and all count."""
    groups = spec.replica_groups
    if groups is None:
        return []
    members: dict[int, list[PodRecord]] = {}
    for pod in current:
        group = group_of(spec, pod.index)
        if (
            group is not None
            and pod.active
            and pod.attempt == memory.attempt
            and (pod.group_generation or 0) == generation(memory, group)
        ):
            members.setdefault(group, []).append(pod)
    started = any(pod.ready for pods in members.values() for pod in pods)
    return [
        group
        for group in range(group_count(spec))
        if group not in hit
        and len({pod.index for pod in members.get(group, [])}) >= groups.size
        and (not started or all(pod.ready for pod in members[group]))
    ]


def shortfall(spec: api.TrainingJobSpec, memory: Memory, current: list[PodRecord], lost: list[PodRecord]) -> str:
    """Why the gang restarts instead of the groups alone (``restart_groups`` returned None)."""
    going_on = training_on(spec, memory, current, hit_groups(spec, lost))
    least = spec.replica_groups.min if spec.replica_groups is not None else 1
    return (
        f"{len(going_on)} of {group_count(spec)} replica group(s) would train on, fewer than "
        f"replicaGroups.min ({least})"
    )


def _group_failure(failures: list[tuple[PodRecord, Failure]]) -> Failure:
    """The one failure event a group's restart is recorded as: its first counted failure, else its
    first; a group whose workers were only deleted from outside restarts uncounted."""
    counted = [failure for _, failure in failures if failure.counted]
    if counted:
        return counted[0]
    if failures:
        return failures[0][1]
    return Failure(
        "WorkersDeleted", counted=False, action="replace", message="worker pods were deleted from outside the operator"
    )


def status_entries(
    spec: api.TrainingJobSpec,
    memory: Memory,
    workers: Iterable[PodRecord],
    node_labels: Mapping[str, Mapping[str, str]] | None = None,
) -> list[dict[str, Any]] | None:
    """status.replicaGroups: each group's generation, restarts, whether all its workers of that
    generation and attempt are ready, and (with replicaGroups.topology) the domain they run in."""
    groups = spec.replica_groups
    if groups is None:
        return None
    ready: dict[int, int] = {}
    domains: dict[int, set[str | None]] = {}
    for pod in workers:
        group = group_of(spec, pod.index)
        if (
            group is None
            or not pod.active
            or pod.attempt != memory.attempt
            or (pod.group_generation or 0) != generation(memory, group)
        ):
            continue
        if pod.ready:
            ready[group] = ready.get(group, 0) + 1
        if groups.topology is not None and pod.node_name:
            domains.setdefault(group, set()).add((node_labels or {}).get(pod.node_name, {}).get(groups.topology))
    held = {state.index: state for state in memory.groups}
    entries: list[dict[str, Any]] = []
    for group in range(group_count(spec)):
        entry: dict[str, Any] = {
            "index": group,
            "generation": held.get(group, GroupState(group)).generation,
            "restarts": held.get(group, GroupState(group)).restarts,
            "ready": ready.get(group, 0) >= groups.size,
        }
        # known once a worker is bound (the pod affinity keeps the others in its domain); absent,
        # not null, when unknown: the stored status (without nulls) compares equal pass after pass
        found = domains.get(group, set())
        if len(found) == 1 and (domain := next(iter(found))) is not None:
            entry["domain"] = domain
        entries.append(entry)
    return entries


def slot_generation(spec: api.TrainingJobSpec, memory: Memory, index: int) -> int:
    """The group generation a new pod of slot ``index`` is made for (0 without groups)."""
    group = group_of(spec, index)
    return 0 if group is None else generation(memory, group)
