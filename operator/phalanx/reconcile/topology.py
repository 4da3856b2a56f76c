"""Topology-aware placement (``spec.placement.topology``): which interconnect domain a job's workers
go to, and whether any domain could ever hold its gang.

Where a gang scheduler places gangs by topology (Kueue's TAS, Volcano's HyperNodes), the operator
only says what it wants (pod annotations, the PodGroup's networkTopology). With scheduler-plugins
or no gang scheduler nothing looks ahead: a pod affinity would let the first pod's node decide the
domain, and a gang could wait forever in a domain too small for it. So the operator chooses, among
the domains whose schedulable nodes (not avoided by the job) could hold workers.min by allocatable,
the one with the least room *now* that still holds the gang (best fit, as Kueue's TAS: a large
gang still finds a whole domain later). Room now is allocatable less what the pods bound to the
nodes request, every tenant's (``Observed.node_free``; the job's own pods hold nothing against it).
Only nodes the pod template's nodeSelector and required node affinity admit are counted (taints
are not judged). The domain is recorded in status and kept while a worker of the current attempt
runs there (on a node that is NotReady or cordoned too: where pods run is not where new ones may
go) or while it can still hold the gang, so elastic growth and spares stay in it; a gang restart
that finds it too small chooses again. A gang none of which the scheduler could place moves to
another domain with room: at once when its domain's pods leave it no room (another tenant's pods
came first), else, when what the nodes' pods request does not explain it (taints, a view that
lags), after ``PATIENCE_SECONDS`` (its unplaced pods recreated there), so two gangs that chose
one domain never wait on each other for good (the limits are in docs/placement.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import capacity, desired, naming, pod_patches
from phalanx.reconcile.actions import NOTHING, Actions, Deletion
from phalanx.reconcile.desired import Object
from phalanx.reconcile.environment import Launch
from phalanx.reconcile.observed import PodRecord, child_kind
from phalanx.reconcile.pass_values import Context, Memory

OPERATOR_PLACED = ("none", "scheduler-plugins")
"""Gang schedulers under which the operator chooses the domain itself."""

PATIENCE_SECONDS = 120.0
"""How long a gang may wait, none of it placed, in a domain where the scheduler finds no room that
what the pods there request does not explain (taints, a lagging view), before the operator tries
another domain that could hold it (its waiting pods are recreated there)."""


@dataclass(frozen=True)
class Room:
    """How many workers a domain's schedulable nodes could hold (-1: unbounded): ``fits`` by
    allocatable (ever, were nothing else there), ``free`` in the room other pods leave them now."""

    domain: str
    fits: int
    nodes: int
    free: int


UNBOUNDED = 1 << 30
"""Where a worker asks for nothing the nodes list: as much room as any."""


def _size(workers: int) -> int:
    return workers if workers >= 0 else UNBOUNDED


@dataclass(frozen=True)
class Placed:
    """The decision: the domain the workers go to (None: not the operator's to choose, or nothing
    known of the nodes), and why the gang can never be placed (reason, message) when it cannot."""

    domain: str | None = None
    stall: tuple[str, str] | None = None
    room: Room | None = None
    """The chosen domain's room when this pass chose it (None: kept, or not chosen)."""
    left: Room | None = None
    """The domain the gang found no room in, when it moves."""
    at_once: bool = False
    """It moves without waiting ``PATIENCE_SECONDS``: the domain's pods leave no room for it."""


def _matches(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, operator = str(expression.get("key", "")), expression.get("operator")
    values = [str(value) for value in expression.get("values") or []]
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    return True  # Gt, Lt: not judged here (the scheduler does)


def may_run_on(pod_spec: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether the template's nodeSelector and required node affinity (by labels) admit a node:
    a domain the job's pods cannot use is never chosen for them."""
    if any(labels.get(key) != value for key, value in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(
        all(_matches(expression, labels) for expression in term.get("matchExpressions") or []) for term in terms
    )


def rooms(context: Context, memory: Memory, launch: Launch, key: str) -> list[Room]:
    """Each domain of ``key`` with the workers its schedulable nodes could hold, most by
    allocatable first (only nodes the pod template admits, ``may_run_on``, and the job does not
    avoid; unready and cordoned nodes have no allocatable)."""
    observed = context.observed
    per_worker = desired.worker_demand(context.job, launch)
    template = context.spec.template.spec.model_dump(by_alias=True, exclude_none=True)
    avoided = set(memory.avoided_nodes)
    members: dict[str, list[str]] = {}
    for node, labels in observed.node_labels.items():
        value = labels.get(key)
        if (
            value is not None
            and node in observed.node_allocatable
            and node not in avoided
            and may_run_on(template, labels)
        ):
            members.setdefault(value, []).append(node)
    found = [
        Room(
            domain,
            capacity.workers_that_fit(per_worker, [observed.node_allocatable[n] for n in nodes]),
            len(nodes),
            capacity.workers_that_fit(per_worker, [observed.node_free(n) for n in nodes]),
        )
        for domain, nodes in members.items()
    ]
    return sorted(found, key=lambda room: (-_size(room.fits), room.domain))


def best_fit(found: list[Room], wanted: int, minimum: int) -> Room | None:
    """The domain with the least room now that still holds ``wanted`` workers, else ``minimum``
    (ties: the first name), as Kueue's TAS chooses: a large gang still finds a whole domain later."""
    for need in (wanted, minimum):
        holding = [room for room in found if _size(room.free) >= need]
        if holding:
            return min(holding, key=lambda room: (_size(room.free), room.domain))
    return None


def most_room(found: list[Room]) -> Room:
    """The domain with the most room now (ties: the most by allocatable, then the first name)."""
    return min(found, key=lambda room: (-_size(room.free), -_size(room.fits), room.domain))


def place(context: Context, memory: Memory, launch: Launch, current: list[PodRecord]) -> Placed:
    """Where this pass puts new workers (see the module's notes)."""
    spec = context.spec
    topology = spec.placement.topology if spec.placement is not None else None
    if topology is None or not context.observed.node_allocatable:
        return Placed(memory.domain)  # nodes are not watched: pod affinity alone (desired.place_in_domain)
    found = rooms(context, memory, launch, topology.key)
    minimum = spec.workers.min
    wanted = max(spec.workers.desired, minimum)
    viable = [room for room in found if _size(room.fits) >= minimum]
    stall = None
    if topology.mode == "required" and not viable:
        stall = ("TopologyUnsatisfiable", unsatisfiable(topology, minimum, found))
    if spec.gang.scheduler not in OPERATOR_PLACED:
        return Placed(None, stall)
    kept = memory.domain
    if kept is not None:
        running_there = any(
            pod.active
            and pod.node_name
            and context.observed.node_labels.get(pod.node_name, {}).get(topology.key) == kept
            for pod in current
        )
        if running_there:
            return Placed(kept)
        held = next((room for room in viable if room.domain == kept), None)
        if held is not None:
            others = [room for room in viable if room.domain != kept]
            if others and found_no_room(current, kept):
                target = best_fit(others, wanted, minimum)
                if topology.mode == "required" and target is not None and _size(held.free) < minimum:
                    # the scheduler and the pods on the nodes agree: no room here, room there (a
                    # preferred gang that found none found none anywhere: no domain held it back)
                    return Placed(target.domain, room=target, left=held, at_once=True)
                if waited_out(context, current, kept):
                    # room there by the view, else the next domain in order of room, round the list
                    order = [room.domain for room in viable]
                    after = order.index(kept) + 1
                    chosen = target or next(room for room in viable[after:] + viable[:after] if room.domain != kept)
                    return Placed(chosen.domain, room=chosen, left=held)
            return Placed(kept, stall)
    if viable:
        chosen = best_fit(viable, wanted, minimum) or most_room(viable)
        return Placed(chosen.domain, room=chosen)
    if topology.mode == "preferred" and found:
        chosen = most_room(found)  # the most room, though not enough: the rest spill over
        return Placed(chosen.domain, room=chosen)
    return Placed(None, stall)


def found_no_room(current: list[PodRecord], domain: str) -> bool:
    """Every worker of the attempt is unplaced and pinned to ``domain``, and the scheduler found
    no node for any of them."""
    waiting = [pod for pod in current if pod.active]
    return bool(waiting) and not any(
        pod.scheduled or not pod.unschedulable_message or pod.domain not in (None, domain) for pod in waiting
    )


def waited_out(context: Context, current: list[PodRecord], domain: str) -> bool:
    """The gang found no room in ``domain`` (``found_no_room``), and the first of its workers was
    created ``PATIENCE_SECONDS`` ago or more."""
    if not found_no_room(current, domain):
        return False
    created = [pod.created for pod in current if pod.active]
    first = min((moment for moment in created if moment is not None), default=None)
    return first is not None and (context.now - first).total_seconds() >= PATIENCE_SECONDS


def unsatisfiable(topology: api.Topology, minimum: int, found: list[Room]) -> str:
    if not found:
        return (
            f"placement.topology requires one {topology.key} domain for the workers, and no schedulable node "
            f"has the label {topology.key}"
        )
    best = found[0]
    return (
        f"placement.topology requires one {topology.key} domain for all of workers.min ({minimum}), and none "
        f"can hold them: the largest, {best.domain} ({best.nodes} node(s)), holds {best.fits}; add nodes to a "
        "domain, lower workers.min or use mode preferred"
    )


def placed_message(key: str, placed: Placed) -> str:
    """The Event that says where the operator placed a job's workers (``placed.room`` is set)."""
    room = placed.room
    assert room is not None
    holds = "as many workers as its nodes take" if room.free < 0 else f"room for {room.free} worker(s)"
    message = f"workers placed in {key}={room.domain}: {room.nodes} schedulable node(s), {holds} by allocatable"
    message += " less what the pods there request"
    left = placed.left
    if left is not None and placed.at_once:
        message += (
            f"; moved from {left.domain}, where none of the gang found room and the pods there leave room for "
            f"{left.free} worker(s)"
        )
    elif left is not None:
        message += f"; moved from {left.domain}, where none of the gang found room for {PATIENCE_SECONDS:.0f}s"
    return message


def rank_host(attempt: int, domain: str | None, index: int, uid: str) -> str:
    """A worker's host name under the ranks Service: the attempt, then a digest of its domain, then
    its slot, so that sorted names put each domain's workers next to each other (the digest keeps
    any label value within a DNS label); the UID's start makes each pod's name its own, so a
    resolver's cached answer never points at a replaced pod."""
    digest = hashlib.sha256((domain or "").encode()).hexdigest()[:8]
    return f"a{attempt}-{digest}-{index:05d}-{uid.replace('-', '')[:8]}"


def rank_addresses(
    context: Context, memory: Memory, launch: Launch, current: list[PodRecord]
) -> tuple[list[Object], Actions]:
    """Ranks follow placement (``desired.ranks_follow_placement``): the EndpointSlices that name
    each placed worker of the attempt under the ranks Service (a thousand slots each,
    ``desired.ranks_shard``), the pods to give their names, and the job's slices no worker needs
    any more, to delete. torchrun's rendezvous numbers its agents in the sort order of their
    addresses, and ``rank_host`` sorts by domain, so the workers of a domain get adjacent node ranks."""
    job = context.job
    topology = job.spec.placement.topology if job.spec.placement is not None else None
    if topology is None or not desired.ranks_follow_placement(job, launch):
        return [], NOTHING
    service = naming.ranks_service_name(job.metadata.name)
    shards: dict[int, list[tuple[str, str, str]]] = {}
    family: str | None = None
    actions = NOTHING
    for pod in sorted(current, key=lambda record: record.index if record.index is not None else -1):
        if not (pod.active and pod.pod_ip and pod.node_name and pod.index is not None and pod.uid):
            continue
        domain = context.observed.node_labels.get(pod.node_name, {}).get(topology.key)
        host = rank_host(memory.attempt, domain, pod.index, pod.uid)
        shards.setdefault(desired.ranks_shard(pod.index), []).append((host, pod.pod_ip, pod.node_name))
        family = family or desired.address_family(pod.pod_ip)
        address = f"{host}.{service}.{job.metadata.namespace}.svc"
        if pod.rank_address != address:
            actions += Actions(address=(pod_patches.rank_address(pod.name, pod.uid, memory.attempt, address),))
    kind = child_kind(desired.ENDPOINT_SLICE_API, "EndpointSlice")
    existing = {
        shard: name
        for child, name in context.observed.objects
        if child == kind and (shard := naming.ranks_slice_shard(job.metadata.name, name)) is not None
    }
    # the first is written once a worker is placed, and kept current (emptied when none is) from
    # then on; any other exists only while a worker of its slots is placed
    if shards or 0 in existing:
        shards.setdefault(0, [])
    slices = [
        desired.ranks_endpoint_slice(job, shard, entries, family or "IPv4") for shard, entries in sorted(shards.items())
    ]
    surplus = sorted(name for shard, name in existing.items() if shard not in shards)
    return slices, actions + Actions(
        delete=tuple(Deletion("EndpointSlice", name, api_version=desired.ENDPOINT_SLICE_API) for name in surplus)
    )
