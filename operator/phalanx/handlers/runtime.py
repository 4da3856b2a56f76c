"""The operator's shared state, created at start-up and reached from handlers through kopf's memo.

It wires the informers to the caches and the caches to the work queue: a change to a job, to
one of its children or to a node its pods run on asks for a pass over that job. A pass over a
job waits until every informer of the job's namespace (and every cluster-wide one) is synced (a
complete list in hand); the moment the last one is, every job there gets a pass. A namespace
whose informers cannot sync (its RoleBinding was removed) holds only its own jobs: it is logged,
exported (``phalanx_watch_scope_synced``) and shown by the health probe.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from phalanx import metrics
from phalanx.api import v1alpha1 as api
from phalanx.cluster.apply import Execution
from phalanx.cluster.cache import (
    ChildCache,
    DeviceCache,
    JobCache,
    JobKey,
    NodeCache,
    NodeRequests,
    WorkloadCache,
)
from phalanx.cluster.client import ApiClient
from phalanx.cluster.events import EventRecorder
from phalanx.cluster.informer import Informer, Resource, Sink
from phalanx.cluster.node_ledger import NodeLedgerStore
from phalanx.cluster.observe import observe_job
from phalanx.cluster.progress import ProgressPoller
from phalanx.cluster.refusals import RefusalMemory
from phalanx.cluster.status_pacing import StatusPacer
from phalanx.cluster.workqueue import WorkQueue
from phalanx.handlers.settings import Settings
from phalanx.reconcile import child_kinds, desired, naming
from phalanx.reconcile.child_kinds import ChildKind
from phalanx.reconcile.observed import Observed

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
    informers: list[Informer] = field(default_factory=list)
    ledger: NodeLedgerStore | None = None  # None when PHALANX_NODE_LEDGER_NAME is unset
    settings: Settings = field(default_factory=Settings)
    events: EventRecorder = field(init=False)

    def __post_init__(self) -> None:
        self.events = EventRecorder(self.client)

    @classmethod
    def start(
        cls,
        client: ApiClient,
        queue: WorkQueue[JobKey],
        settings: Settings,
    ) -> Runtime:
        """Build the caches and the informers that feed them (not yet running)."""
        runtime = cls(client=client, queue=queue, settings=settings)
        namespaces, watch_nodes, watch_seconds = settings.watch_namespaces, settings.watch_nodes, settings.watch_seconds
        runtime.jobs = JobCache(on_change=runtime._job_changed)
        runtime.children = ChildCache(on_change=runtime._child_changed, on_pod_gone=runtime._pod_gone)
        runtime.nodes = NodeCache(on_change=runtime._node_changed, on_capacity=runtime._capacity_changed)
        runtime.requests = NodeRequests(on_release=runtime._capacity_changed)
        runtime.workloads = WorkloadCache(on_change=runtime._workload_changed)
        runtime.devices = DeviceCache(on_capacity=runtime._capacity_changed)
        owned = naming.JOB_NAME_LABEL  # only our children cross the wire
        scopes: Sequence[str | None] = tuple(namespaces) if namespaces else (None,)
        children: list[tuple[Resource, Sink, str | None, bool]] = []
        for kind in child_kinds.watched(isolating=settings.job_isolation is not None):
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
                        absent_recheck_seconds=settings.absent_api_recheck_seconds,
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
                        absent_recheck_seconds=settings.absent_api_recheck_seconds,
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
        """What only the replica that reconciles does besides the queue: scraping workers, reading
        the node ledger again."""
        work: list[tuple[str, Callable[[], Awaitable[None]]]] = []
        if self.progress is not None:
            work.append(("progress poller", self.progress.run))
        if self.ledger is not None:
            work.append(("node ledger", self.ledger.refresh_forever))
        return work

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

    def observe(self, job: api.TrainingJob) -> Observed:
        return observe_job(
            job,
            self.children,
            nodes=self.nodes,
            devices=self.devices,
            requests=self.requests,
            workloads=self.workloads,
            progress=self.progress,
            refusals=self.refusals,
            missing_apis=self.missing_apis(job.metadata.namespace),
            isolation=self.settings.job_isolation,
            node_lost_grace_seconds=self.settings.node_lost_grace_seconds,
            force_delete_on_node_lost=self.settings.force_delete_on_node_lost,
            spare_priority_class=self.settings.spare_priority_class,
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
