"""The operator's shared state, created at start-up and reached from handlers through kopf's memo.

It wires the informers to the caches and the caches to the work queue: a change to a job, to
one of its children or to a node its pods run on asks for a pass over that job. A pass over a
job waits until every informer of the job's namespace (and every cluster-wide one) is synced (a
complete list in hand); the moment the last one is, every job there gets a pass. A namespace
whose informers cannot sync (its RoleBinding was removed) holds only its own jobs: it is logged,
exported (``phalanx_watch_scope_synced``) and shown by the health probe.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from phalanx import metrics
from phalanx.api import v1alpha1 as api
from phalanx.api.admission import DNS_1123_SUBDOMAIN, DNS_1123_SUBDOMAIN_MESSAGE
from phalanx.cluster.apply import Execution, RefusalMemory, StatusPacer
from phalanx.cluster.cache import (
    ChildCache,
    DeviceCache,
    JobCache,
    JobKey,
    NodeCache,
    NodeRequests,
    WorkloadCache,
    with_devices,
)
from phalanx.cluster.client import ApiClient
from phalanx.cluster.events import EventRecorder
from phalanx.cluster.informer import Informer, Resource, Sink
from phalanx.cluster.progress import ProgressPoller
from phalanx.cluster.workqueue import WorkQueue
from phalanx.reconcile import child_kinds, desired, naming
from phalanx.reconcile.child_kinds import ChildKind
from phalanx.reconcile.observed import NODE_LOST_GRACE_SECONDS, JobIsolation, NodeLoss, Observed

WATCH_NAMESPACES = "PHALANX_WATCH_NAMESPACES"
JOB_NETWORK_POLICY = "PHALANX_JOB_NETWORK_POLICY"
JOB_NETWORK_POLICY_SCRAPERS = "PHALANX_JOB_NETWORK_POLICY_SCRAPERS"
NODE_LOST_GRACE = "PHALANX_NODE_LOST_GRACE_SECONDS"
FORCE_DELETE_ON_NODE_LOST = "PHALANX_FORCE_DELETE_ON_NODE_LOST"
SPARE_PRIORITY_CLASS = "PHALANX_SPARE_PRIORITY_CLASS"

TRAINING_JOBS = Resource(api.API_VERSION, api.PLURAL, api.KIND)
NODES = Resource("v1", "nodes", "Node", namespaced=False)
# every namespace's pods as one cluster-wide view (what they request of their nodes), not a scope of jobs
BOUND_PODS = Resource("v1", "pods", "Pod", namespaced=False)
BOUND_PODS_SELECTOR = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
RESOURCE_SLICES = Resource(desired.RESOURCE_API, "resourceslices", "ResourceSlice", namespaced=False)
DEVICE_CLASSES = Resource(desired.RESOURCE_API, "deviceclasses", "DeviceClass", namespaced=False)


def child_resource(kind: ChildKind) -> Resource:
    """What an informer of a child kind lists and watches."""
    return Resource(kind.api_version, kind.plural, kind.kind)


def watched_namespaces() -> tuple[str, ...] | None:
    """The namespaces `phalanx run` was given (None: all), as the CLI hands them over."""
    value = os.environ.get(WATCH_NAMESPACES, "")
    names = tuple(name for name in value.split(",") if name)
    return names or None


def job_isolation() -> JobIsolation | None:
    """Whether each job gets a NetworkPolicy of its own (PHALANX_JOB_NETWORK_POLICY), and who
    besides its pods may scrape them (PHALANX_JOB_NETWORK_POLICY_SCRAPERS, a JSON list of
    NetworkPolicyPeers). A setting that cannot be used keeps the operator from starting."""
    if os.environ.get(JOB_NETWORK_POLICY, "").strip().lower() not in ("1", "true", "yes"):
        return None
    try:
        peers = desired.network_policy_peers(json.loads(os.environ.get(JOB_NETWORK_POLICY_SCRAPERS) or "[]"))
    except ValueError as error:
        raise ValueError(f"{JOB_NETWORK_POLICY_SCRAPERS}: {error}") from error
    return JobIsolation(scrapers=peers)


def node_loss_settings() -> tuple[float, bool]:
    """How long a node may be not Ready before its pods are taken for lost (default 300 s, as
    Kubernetes' taint-based eviction), and whether their pods are then force-deleted (default no:
    the container may still run). From the environment, which the chart and `phalanx run` set."""
    text = os.environ.get(NODE_LOST_GRACE, "") or str(NODE_LOST_GRACE_SECONDS)
    try:
        grace = float(text)
    except ValueError:
        grace = -1.0
    if not grace >= 0:  # also refuses NaN
        raise ValueError(f"{NODE_LOST_GRACE} must be a number of seconds >= 0, not {text!r}")
    return grace, os.environ.get(FORCE_DELETE_ON_NODE_LOST, "0") == "1"


def spare_priority_class() -> str | None:
    """The PriorityClass warm spares get so that they rank below workers (``desired.spare_pod``):
    PHALANX_SPARE_PRIORITY_CLASS, which the chart sets to the class it installs; unset or empty:
    none, spares take the workers' class. A name the API server would refuse keeps the operator
    from starting (every spare would be refused)."""
    name = os.environ.get(SPARE_PRIORITY_CLASS, "").strip()
    if name and (len(name) > 253 or not DNS_1123_SUBDOMAIN.match(name)):
        why = DNS_1123_SUBDOMAIN_MESSAGE
        raise ValueError(f"{SPARE_PRIORITY_CLASS} {name[:253]!r} is no PriorityClass name: {why}")
    return name or None


@dataclass
class Runtime:
    """Client, caches, informers and the work queue of one operator process."""

    client: ApiClient
    queue: WorkQueue[JobKey]
    jobs: JobCache = field(default_factory=JobCache)
    children: ChildCache = field(default_factory=ChildCache)
    nodes: NodeCache = field(default_factory=NodeCache)
    requests: NodeRequests = field(default_factory=NodeRequests)
    workloads: WorkloadCache = field(default_factory=WorkloadCache)
    devices: DeviceCache = field(default_factory=DeviceCache)
    refusals: RefusalMemory = field(default_factory=RefusalMemory)
    pacer: StatusPacer = field(default_factory=StatusPacer)
    progress: ProgressPoller | None = None  # None when PHALANX_PROGRESS_INTERVAL_SECONDS is 0
    isolation: JobIsolation | None = None  # each job's NetworkPolicy, when the operator renders them
    informers: list[Informer] = field(default_factory=list)
    node_lost_grace_seconds: float = NODE_LOST_GRACE_SECONDS
    force_delete_on_node_lost: bool = False
    spare_priority_class: str | None = None  # PHALANX_SPARE_PRIORITY_CLASS
    events: EventRecorder = field(init=False)

    def __post_init__(self) -> None:
        self.events = EventRecorder(self.client)

    @classmethod
    def start(
        cls,
        client: ApiClient,
        queue: WorkQueue[JobKey],
        *,
        namespaces: Sequence[str] | None,
        watch_nodes: bool,
        watch_seconds: int = 300,
        isolation: JobIsolation | None = None,
    ) -> Runtime:
        """Build the caches and the informers that feed them (not yet running)."""
        runtime = cls(client=client, queue=queue, isolation=isolation or job_isolation())
        runtime.node_lost_grace_seconds, runtime.force_delete_on_node_lost = node_loss_settings()
        runtime.spare_priority_class = spare_priority_class()
        runtime.jobs = JobCache(on_change=runtime._job_changed)
        runtime.children = ChildCache(on_change=runtime._child_changed, on_pod_gone=runtime._pod_gone)
        runtime.nodes = NodeCache(on_change=runtime._node_changed, on_capacity=runtime._capacity_changed)
        runtime.requests = NodeRequests(on_release=runtime._capacity_changed)
        runtime.workloads = WorkloadCache(on_change=runtime._workload_changed)
        runtime.devices = DeviceCache(on_capacity=runtime._capacity_changed)
        owned = naming.JOB_NAME_LABEL  # only our children cross the wire
        scopes: Sequence[str | None] = tuple(namespaces) if namespaces else (None,)
        children: list[tuple[Resource, Sink, str | None, bool]] = []
        for kind in child_kinds.watched(isolating=runtime.isolation is not None):
            named = kind.informer == "named"  # Kueue's Workloads: named after our pod groups, not labelled
            sink: Sink = runtime.workloads if named else runtime.children
            children.append((child_resource(kind), sink, None if named else owned, kind.optional))
        for scope in scopes:
            for resource, sink, selector, optional in ((TRAINING_JOBS, runtime.jobs, None, False), *children):
                runtime.informers.append(
                    Informer(
                        client,
                        resource,
                        sink,
                        namespace=scope,
                        label_selector=selector,
                        watch_seconds=watch_seconds,
                        on_change=runtime._informer_changed,
                        optional=optional,
                    )
                )
        if watch_nodes:
            for resource, cluster_sink, fields in (
                (NODES, runtime.nodes, None),
                (RESOURCE_SLICES, runtime.devices, None),  # DRA devices, for the capacity judgement
                (DEVICE_CLASSES, runtime.devices, None),
                # what every tenant's pods hold of their nodes, for placement by topology
                (BOUND_PODS, runtime.requests, BOUND_PODS_SELECTOR),
            ):
                runtime.informers.append(
                    Informer(
                        client,
                        resource,
                        cluster_sink,
                        field_selector=fields,
                        watch_seconds=watch_seconds,
                        on_change=runtime._informer_changed,
                        optional=True,
                    )
                )
        return runtime

    def background(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """The long-running work every replica does besides the queue: the watches (a standby
        keeps its caches synced) and the event senders (name and coroutine function, for the
        caller to supervise)."""
        work: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            (f"watch of {informer}", informer.run) for informer in self.informers
        ]
        work.append(("event recorder", self.events.run))
        return work

    def leader_work(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        """What only the replica that reconciles does besides the queue: scraping workers."""
        return [("progress poller", self.progress.run)] if self.progress is not None else []

    # -- what wakes a job ------------------------------------------------------------------------

    def _job_changed(self, key: JobKey, gone: bool) -> None:
        if not gone:
            self.queue.enqueue(key)
            return
        self.forget(key)

    def forget(self, key: JobKey) -> None:
        """Drop everything kept for a job that no longer exists (again after a pass that was
        running when it went: that pass may have filed its metrics and status pacing anew)."""
        self.queue.forget(key)
        self.refusals.forget_job(key)
        self.pacer.forget(key)
        if self.progress is not None:
            self.progress.forget(key)
        metrics.forget_job(key)

    def _child_changed(self, key: JobKey) -> None:
        if self.jobs.get(key) is not None:
            self.queue.enqueue(key)

    def _pod_gone(self, namespace: str) -> None:
        """A pod went away: quota it held may let a refused creation through now (each such job may
        send one probe, at most every few seconds), and what it held on its node may let a waiting
        gang be placed (its PodGroup is stamped at most every NODE_CAPACITY_STAMP_SECONDS)."""
        for key in self.refusals.quota_freed(namespace):
            self.queue.enqueue(key)
        self.nodes.pod_released()

    def _node_changed(self, name: str) -> None:
        for key in self.children.jobs_on_node(name):
            self.queue.enqueue(key)

    def _workload_changed(self, namespace: str, name: str) -> None:
        job = naming.kueue_group_job(name)
        if job is not None and self.jobs.get((namespace, job)) is not None:
            self.queue.enqueue((namespace, job))

    def _capacity_changed(self) -> None:
        """Nodes offer something new: jobs waiting for nodes may be placed now."""
        for key in self.children.jobs_waiting_for_nodes():
            self.queue.enqueue(key)

    def _informer_changed(self, informer: Informer) -> None:
        metrics.observe_informer(str(informer.resource), informer.namespace, informer.relists, informer.synced.is_set())
        for scope in self.scopes():
            metrics.observe_scope(scope, self.synced(scope))
        if not informer.synced.is_set():
            return
        for key in self.jobs.keys():  # noqa: SIM118 - JobCache, not a dict
            if informer.namespace in (None, key[0]) and self.synced(key[0]):
                self.queue.enqueue(key)

    # -- what a pass reads -----------------------------------------------------------------------

    def scopes(self) -> list[str | None]:
        """The namespaces watched one by one (None: the whole cluster at once)."""
        return list(dict.fromkeys(informer.namespace for informer in self.informers if informer.resource.namespaced))

    def synced(self, namespace: str | None = None) -> bool:
        """Every cache a pass over a job in ``namespace`` reads has a complete list in hand: the
        informers of that namespace and the cluster-wide ones (None: every informer)."""
        return all(
            informer.synced.is_set()
            for informer in self.informers
            if namespace is None or informer.namespace in (None, namespace)
        )

    def unsynced_scopes(self) -> list[str]:
        """Namespaces (or "cluster" for a cluster-wide watch) whose jobs wait for a complete list."""
        return [scope or "cluster" for scope in self.scopes() if not self.synced(scope)]

    def missing_apis(self, namespace: str) -> dict[str, str]:
        """APIs of optional children (PodGroups, ResourceClaimTemplates) the operator cannot use in
        a namespace, with the reason."""
        stalling = {(kind.api_version, kind.kind) for kind in child_kinds.stalling_when_missing()}
        return {
            informer.resource.api_version: informer.absent_reason
            for informer in self.informers
            if informer.absent
            and (informer.resource.api_version, informer.resource.kind) in stalling
            and informer.namespace in (None, namespace)
        }

    def capacity(self) -> str:
        """The fingerprint of what schedulable nodes offer, their DRA devices included."""
        nodes, devices = self.nodes.capacity(), self.devices.fingerprint()
        if not (nodes and devices):
            return nodes  # "": no node known, nothing to judge
        return hashlib.sha256(f"{nodes}/{devices}".encode()).hexdigest()[:16]

    def observe(self, job: api.TrainingJob) -> Observed:
        key = (job.metadata.namespace, job.metadata.name)
        observed = self.children.observed(
            job.metadata.namespace,
            job.metadata.name,
            job.metadata.uid,
            self.nodes.unready(),
            progress=self.progress.get(key) if self.progress is not None else None,
            completion=self.progress.completion(key) if self.progress is not None else None,
            reported=self.progress.reported(key) if self.progress is not None else None,
            refusals=self.refusals.of(job.metadata.uid),
            missing_apis=self.missing_apis(job.metadata.namespace),
            node_capacity=self.capacity(),
            node_allocatable=with_devices(self.nodes.allocatable(), self.devices.per_node()),
            node_labels=self.nodes.labels(),
            node_requested=self.requests,
            workload=self.workloads.get(
                job.metadata.namespace, naming.kueue_group_name(job.metadata.name, job.status.attempt)
            )
            if job.spec.gang.scheduler == "kueue"
            else None,
        )
        node_loss = NodeLoss(
            unready_since=self.nodes.unready_since(),
            deleted=self.nodes.deleted(),
            grace_seconds=self.node_lost_grace_seconds,
            force_delete=self.force_delete_on_node_lost,
        )
        return replace(
            observed,
            node_loss=node_loss,
            retry_batch=self.refusals.batch(job.metadata.uid),
            isolation=self.isolation,
            spare_priority_class=self.spare_priority_class,
        )

    def execution(self) -> Execution:
        return Execution(
            client=self.client,
            jobs=self.jobs,
            children=self.children,
            refusals=self.refusals,
            events=self.events,
            pacer=self.pacer,
        )
