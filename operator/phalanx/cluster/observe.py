"""What the planner is given about one TrainingJob: the one place an ``Observed`` is built.

A pass reads the caches the informers fill (the job's children, the nodes, their DRA devices,
what every tenant's pods hold of them, Kueue's Workloads), what the progress poller scraped, what
the API server refused, and the operator's settings, and hands the planner one immutable value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from decimal import Decimal

from phalanx.api import v1alpha1 as api
from phalanx.cluster.cache import ChildCache, DeviceCache, NodeCache, NodeRequests, WorkloadCache
from phalanx.cluster.progress import ProgressPoller
from phalanx.cluster.refusals import RefusalMemory
from phalanx.reconcile import naming
from phalanx.reconcile.observed import NODE_LOST_GRACE_SECONDS, JobIsolation, NodeLoss, Observed


def node_capacity(nodes: NodeCache, devices: DeviceCache) -> str:
    """The fingerprint of what schedulable nodes offer, their DRA devices included ("" when no node
    is known: nothing to judge)."""
    offered, published = nodes.capacity(), devices.fingerprint()
    if not (offered and published):
        return offered
    return hashlib.sha256(f"{offered}/{published}".encode()).hexdigest()[:16]


def with_devices(
    allocatable: Mapping[str, Mapping[str, Decimal]], devices: Mapping[str, Mapping[str, Decimal]]
) -> Mapping[str, Mapping[str, Decimal]]:
    """Each schedulable node's allocatable with its DRA devices per class beside it (nodes that are
    not schedulable offer no devices either)."""
    if not devices:
        return allocatable
    return {name: {**offer, **devices.get(name, {})} for name, offer in allocatable.items()}


def observe_job(
    job: api.TrainingJob,
    children: ChildCache,
    *,
    nodes: NodeCache | None = None,
    devices: DeviceCache | None = None,
    requests: NodeRequests | None = None,
    workloads: WorkloadCache | None = None,
    progress: ProgressPoller | None = None,
    refusals: RefusalMemory | None = None,
    missing_apis: Mapping[str, str] | None = None,
    isolation: JobIsolation | None = None,
    node_lost_grace_seconds: float = NODE_LOST_GRACE_SECONDS,
    force_delete_on_node_lost: bool = False,
    spare_priority_class: str | None = None,
) -> Observed:
    """Everything known of ``job``'s children and of the nodes they may run on, as of now. A source
    left out counts as empty (nodes not watched, no poller, nothing refused)."""
    namespace, name, uid = job.metadata.namespace, job.metadata.name, job.metadata.uid
    key = (namespace, name)
    pods = children.pods_of(namespace, uid)
    nodes = nodes if nodes is not None else NodeCache()
    devices = devices if devices is not None else DeviceCache()
    workload = None
    if workloads is not None and job.spec.gang.scheduler == "kueue":
        workload = workloads.get(namespace, naming.kueue_group_name(name, job.status.attempt))
    return Observed(
        pods=pods,
        objects=children.objects_of(namespace, uid),
        unready_nodes=nodes.unready(),
        progress=progress.get(key) if progress is not None else None,
        completion=progress.completion(key) if progress is not None else None,
        reported=progress.reported(key) if progress is not None else None,
        stragglers=progress.stragglers(key) if progress is not None else (),
        foreign=children.foreign(namespace, name, uid),
        refusals=refusals.of(uid) if refusals is not None else {},
        missing_apis=dict(missing_apis or {}),
        node_capacity=node_capacity(nodes, devices),
        node_allocatable=with_devices(nodes.allocatable(), devices.per_node()) or {},
        node_labels=nodes.labels() or {},
        node_requested=requests.requested() if requests is not None else {},
        own_requested=requests.held_by((namespace, pod.name) for pod in pods) if requests is not None else {},
        workload=workload,
        isolation=isolation,
        node_loss=NodeLoss(
            unready_since=nodes.unready_since(),
            deleted=nodes.deleted(),
            grace_seconds=node_lost_grace_seconds,
            force_delete=force_delete_on_node_lost,
        ),
        retry_batch=refusals.batch(uid) if refusals is not None else 1,
        spare_priority_class=spare_priority_class,
    )
