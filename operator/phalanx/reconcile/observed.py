"""Compact records of the children the operator observes.

A parsed Pod dict costs tens of KiB in Python; the planner needs a dozen facts. The
watch layer turns each event into one of these records at once and keeps only the
record, so memory grows by a few hundred bytes per pod, not by the whole object.

Worker pods are the tenant's to edit, so every label and annotation value read from one is
checked against its format and length (``POD_LABELS``, ``POD_ANNOTATIONS``) before it enters a
record: anything else is treated as absent, and the record names the key (``PodRecord.ignored``)
for the cache to warn about once.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from phalanx.reconcile import naming
from phalanx.reconcile.status import parse_time
from phalanx.reconcile.stragglers import Straggler


@dataclass(frozen=True, slots=True)
class PodRecord:
    """What the planner needs to know about one pod."""

    name: str
    role: str
    index: int | None = None
    attempt: int | None = None
    spec_hash: str | None = None
    group_total: int | None = None
    phase: str = "Pending"
    reason: str | None = None
    ready: bool = False
    scheduled: bool = False
    node_name: str | None = None
    pod_ip: str | None = None
    deleting: bool = False
    created: datetime | None = None
    exit_code: int | None = None
    terminated_reason: str | None = None
    termination_message: str | None = None
    waiting_reason: str | None = None
    waiting_message: str | None = None
    disruption_reason: str | None = None
    unschedulable_message: str | None = None
    metrics_port: int | None = None
    uid: str = ""
    namespace: str = ""
    owner_name: str | None = None
    host_network: bool = False
    """The pod shares its node's network: its IP is the node's, and its ports the node's."""
    rendezvous_id: str | None = None
    """The ``phalanx.dev/rendezvous-id`` annotation: set on pods whose command runs
    phalanx-supervise, which can be moved to a new attempt in place."""
    rank_address: str | None = None
    """The ``phalanx.dev/rank-address`` annotation (``topology.rank_addresses``)."""
    domain: str | None = None
    """The ``phalanx.dev/domain`` annotation: the topology domain the operator placed the pod in."""
    group_generation: int | None = None
    """The ``phalanx.dev/group-generation`` label (spec.replicaGroups): the generation of the
    worker's replica group the pod was made for."""
    save_now: str | None = None
    """The ``phalanx.dev/save-now`` annotation: the save-now token the operator carried onto the pod."""
    ignored: tuple[str, ...] = ()
    """Keys of labels and annotations read from the pod whose value was too long or malformed
    (``POD_LABELS``, ``POD_ANNOTATIONS``), each read as absent."""

    @property
    def finished(self) -> bool:
        """The pod ran to an end (Succeeded or Failed)."""
        return self.phase in ("Succeeded", "Failed")

    @property
    def active(self) -> bool:
        """The pod exists, is not being deleted and has not finished."""
        return not self.deleting and not self.finished


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """A Service or PodGroup the operator owns."""

    kind: str
    name: str
    spec_hash: str | None = None
    phase: str | None = None
    uid: str = ""
    node_capacity: str | None = None
    """A PodGroup's ``phalanx.dev/node-capacity`` annotation: ``<fingerprint>@<time>``."""
    node_capacity_at: datetime | None = None
    """The time in ``node_capacity`` (None when it has none or one that does not parse)."""


@dataclass(frozen=True)
class QueuedWorkload:
    """What Kueue says about the Workload of a job's pod group (named like the group)."""

    name: str
    admitted: bool
    message: str = ""
    """Why it is not admitted yet, in Kueue's words (its QuotaReserved condition)."""
    evicted: str | None = None
    """The reason of its Evicted condition (Preempted, PodsReadyTimeout, ...), when true."""
    uid: str = ""
    boost_text: str | None = None
    """Its ``kueue.x-k8s.io/priority-boost`` annotation as written (None: absent; longer than
    ``MAX_BOOST_TEXT`` reads as unreadable, "")."""
    annotated: bool = False
    """Whether it has any annotations (a JSON patch adds a key only to a map that exists)."""

    @property
    def boost(self) -> int:
        """The boost Kueue applies: the annotation as an integer, 0 when absent or unreadable."""
        text = self.boost_text or ""
        return int(text) if re.fullmatch(r"[+-]?[0-9]{1,10}", text) else 0


@dataclass(frozen=True)
class WorkerProgress:
    """What a worker of the job reported on its metrics endpoint (the operator scrapes one)."""

    attempt: int
    """The gang attempt of the worker that reported it."""

    world_size: int | None = None
    checkpoint_step: int | None = None
    checkpoint_time: datetime | None = None
    checkpoint_save_now: int | None = None
    """``protocol.save_now_key`` of the save-now token that checkpoint answered (None: none)."""
    step: int | None = None
    """The training step the reporter last completed (``phalanx_worker_step``)."""
    resumed_step: int | None = None
    """The step the reporter's current run of processes began at (``phalanx_worker_resumed_step``)."""
    run_started: datetime | None = None
    """When the reporter's current run of processes began: a new value is a new run."""
    steps: int | None = None
    """The reporting process's step counter (``phalanx_worker_steps_total``); None when it serves none."""
    reporter: str = ""
    """UID of the pod that reported it: another pod's counter is another count."""
    stepped_since: datetime | None = None
    """When the answer that first showed ``steps`` at its current value from this reporter came
    (hang detection): the count changed no later than that."""
    scraped_at: datetime | None = None
    """When the scrape that got the reporter's last readable page was sent: its counts held at
    least until then (hang detection judges only a sample scraped after its deadline ran out)."""
    fresh_until: datetime | None = None
    """Past this (a few poll intervals after ``scraped_at``) the sample is no verdict on the job: the
    reporter stopped answering, and its last step count says nothing about training since."""
    unanswered: int = 0
    """Scrapes of the reporter in a row since ``scraped_at`` that got no readable answer."""


@dataclass(frozen=True)
class Completion:
    """A worker recorded in the rendezvous store that training completed (the store pod serves it).

    The store outlives every worker process, so this survives a rank that completed and then
    died in teardown while its peers' agents still wait for one another.
    """

    attempt: int
    step: int | None = None
    rank: int | None = None
    job_uid: str = ""
    """The UID of the TrainingJob the writing rank belongs to (``PHALANX_JOB_UID``): anyone who can
    reach the store can write the key, and only a record naming this job and its current attempt
    ends it."""


@dataclass(frozen=True)
class ReportedMetric:
    """One named training metric of a progress report, with the step and time it was taken at."""

    name: str
    value: float
    step: int
    time: datetime


@dataclass(frozen=True)
class ReportedProgress:
    """Rank 0's latest progress report (``phalanx.worker.report``), as the store pod serves it.

    The record outlives the attempt that wrote it: after a gang restart it is the job's last known
    progress until the new attempt reports, so it counts whatever its ``attempt`` (the planner
    restarts its rate window when the step goes back). A record naming another job never counts."""

    job_uid: str
    """The UID of the TrainingJob the record names (``PHALANX_JOB_UID``)."""
    attempt: int
    step: int
    total_steps: int | None
    time: datetime
    """When rank 0 made the report (its clock)."""
    metrics: tuple[ReportedMetric, ...] = ()
    """At most ``naming.PROGRESS_MAX_METRICS``, by name."""


@dataclass(frozen=True)
class JobIsolation:
    """The operator's setting to fence each job's pods with a NetworkPolicy of the job's own
    (``PHALANX_JOB_NETWORK_POLICY``)."""

    scrapers: tuple[Mapping[str, Any], ...] = ()
    """NetworkPolicyPeers admitted to the metrics port besides the job's pods (the operator, a
    Prometheus); none: only the job's pods reach any port."""


ChildKey = tuple[str, str]
"""(child kind, name) of a child: the store's Service and pod share a name (``child_kind``)."""


def child_kind(api_version: str, kind: str) -> str:
    """The kind that tells a job's children apart: qualified by its API group outside the core
    group, since both gang schedulers call theirs PodGroup (``PodGroup.scheduling.x-k8s.io``)."""
    group = api_version.rpartition("/")[0]
    return f"{kind}.{group}" if group else kind


@dataclass(frozen=True)
class Refusal:
    """The API server's answer to our last attempts to create one child, when it said no for a
    reason that may pass (a quota, a name taken by an object we do not own, missing permission)."""

    reason: str
    message: str
    first: datetime
    last: datetime
    attempts: int = 1
    retry_now: bool = False
    """Something changed that may let it pass (a pod of the namespace went away, freeing quota)."""


NODE_LOST_GRACE_SECONDS = 300.0
"""Kubernetes' default toleration of the not-ready and unreachable taints (DefaultTolerationSeconds)."""


@dataclass(frozen=True)
class NodeLoss:
    """When pods on a node that is not Ready are taken for lost, and how they are deleted.

    A Ready blip (a slow kubelet, a control-plane brownout) must change nothing: like the node
    lifecycle controller, the operator waits ``grace_seconds`` before it acts on a node, and it never
    force-deletes a pod whose container may still run (two agents for one slot) unless the node
    object is gone or the operator was told to (``force_delete``)."""

    unready_since: Mapping[str, datetime] = field(default_factory=dict)
    """Node -> since when its Ready condition has not been True (see ``NodeCache``)."""
    deleted: frozenset[str] = frozenset()
    """Nodes deleted from the API: no kubelet will ever stop or confirm their pods."""
    grace_seconds: float = NODE_LOST_GRACE_SECONDS
    force_delete: bool = False
    """Force-delete the pods of a node lost past the grace (the operator's opt-in)."""


@dataclass(frozen=True)
class Observed:
    """Everything observed about one TrainingJob's children."""

    pods: tuple[PodRecord, ...] = ()
    objects: Mapping[ChildKey, ObjectRecord] = field(default_factory=dict)
    """Services and PodGroups by (``child_kind``, name)."""
    unready_nodes: frozenset[str] = frozenset()
    """Nodes whose Ready condition is not True now."""
    progress: WorkerProgress | None = None
    completion: Completion | None = None
    reported: ReportedProgress | None = None
    """Rank 0's latest progress report, from the store pod (any job's: the planner checks the UID)."""
    foreign: frozenset[ChildKey] = frozenset()
    """(child kind, name) of objects labelled with this job's name that another owner (or none) controls."""
    refusals: Mapping[ChildKey, Refusal] = field(default_factory=dict)
    """By (child kind, name): creations the API server refused for a reason that may pass."""
    missing_apis: Mapping[str, str] = field(default_factory=dict)
    """API (e.g. ``scheduling.x-k8s.io/v1alpha1 podgroups``) -> why the operator cannot use it."""
    node_capacity: str = ""
    """Fingerprint of the schedulable nodes' capacity ("" when nodes are not watched)."""
    node_allocatable: Mapping[str, Mapping[str, Decimal]] = field(default_factory=dict)
    """Node name -> allocatable resources of each schedulable node, in base units (empty when nodes
    are not watched)."""
    node_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Node name -> labels of every node that exists, Ready or not, cordoned or not (empty when
    nodes are not watched): where pods run; ``node_allocatable`` says where new ones may go."""
    node_requested: Mapping[str, Mapping[str, Decimal]] = field(default_factory=dict)
    """Node name -> what the pods bound to it request, every namespace's (empty when not watched)."""
    own_requested: Mapping[str, Mapping[str, Decimal]] = field(default_factory=dict)
    """Node name -> what this job's own pods bound to it request (part of ``node_requested``)."""
    workload: QueuedWorkload | None = None
    """Kueue's Workload for the current attempt's pod group (gang.scheduler kueue)."""
    isolation: JobIsolation | None = None
    """Whether (and how) the job's pods are fenced by a NetworkPolicy; None: the operator renders none."""
    node_loss: NodeLoss = field(default_factory=NodeLoss)
    """Since when ``unready_nodes`` are not Ready, deleted nodes, and the operator's node settings."""
    retry_batch: int = 1
    """How many pods a pass may create while creations of this job are refused: a slow start, one
    probe after a refusal, doubled as creations pass (``RefusalMemory.batch``)."""
    spare_priority_class: str | None = None
    """The PriorityClass the operator gives warm spares (``PHALANX_SPARE_PRIORITY_CLASS``; the chart's
    ``phalanx-spare``), so that they rank below workers; None: spares take the workers' class."""
    # -- the node ledger (issue 34) --
    ledger_avoided: frozenset[str] = frozenset()
    """Nodes the cluster-wide node ledger scores past its threshold (``reconcile.node_ledger``):
    every job's new pods keep off them."""
    stragglers: tuple[Straggler, ...] = ()
    """Ranks of the current attempt the progress poller found persistently slower than the others
    (``reconcile.stragglers``; only with the node ledger on): evidence against their pods' nodes."""

    def workers(self) -> list[PodRecord]:
        """Worker pods, any attempt."""
        return [pod for pod in self.pods if pod.role == naming.ROLE_WORKER]

    def spares(self) -> list[PodRecord]:
        """Warm spare pods (``workers.spares``), not yet promoted into a slot."""
        return [pod for pod in self.pods if pod.role == naming.ROLE_SPARE]

    def store(self) -> PodRecord | None:
        """The rendezvous store pod, if it exists."""
        return next((pod for pod in self.pods if pod.role == naming.ROLE_RENDEZVOUS), None)

    def node_free(self, node: str) -> dict[str, Decimal]:
        """What a schedulable node has left for this job's pods: its allocatable less what other
        pods bound to it request (never below 0). The job's own pods do not count: a gang's
        placed workers hold their slots already, and its stopping pods make room for it."""
        requested = self.node_requested.get(node, {})
        own = self.own_requested.get(node, {})
        return {
            name: max(Decimal(0), offer - requested.get(name, Decimal(0)) + own.get(name, Decimal(0)))
            for name, offer in self.node_allocatable.get(node, {}).items()
        }

    def has(self, kind: str, name: str) -> bool:
        """Whether a Service or PodGroup exists (``kind``: its ``child_kind``)."""
        return (kind, name) in self.objects


@dataclass(frozen=True)
class ValueFormat:
    """What a label or annotation value read from a pod may be: ``pattern``, at most ``limit``
    characters (checked first, so a huge value costs no match)."""

    what: str
    pattern: re.Pattern[str]
    limit: int

    def accepts(self, value: object) -> bool:
        return isinstance(value, str) and len(value) <= self.limit and self.pattern.fullmatch(value) is not None


COUNT = ValueFormat("a decimal integer of at most 9 digits", re.compile(r"0|[1-9][0-9]*"), 9)
LABEL_VALUE = ValueFormat(
    "a label value of at most 63 characters", re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"), 63
)
DNS_LABEL = ValueFormat("a DNS label of at most 63 characters", re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"), 63)
DNS_NAME = ValueFormat(
    "a DNS name of at most 253 characters",
    re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"),
    253,
)
SAVE_NOW_TOKEN = ValueFormat(
    "a token of at most 63 letters, digits and '-_.:+', beginning and ending with a letter or digit "
    "(a timestamp such as 2026-01-31T12:00:00Z, say)",
    re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.:+]*[A-Za-z0-9])?"),
    63,
)
"""A ``phalanx.dev/save-now`` token, on the job (the user's) and on its pods (the operator's copy)."""

POD_LABELS: Mapping[str, ValueFormat] = {
    naming.ROLE_LABEL: LABEL_VALUE,
    naming.WORKER_INDEX_LABEL: COUNT,
    naming.ATTEMPT_LABEL: COUNT,
    naming.GROUP_GENERATION_LABEL: COUNT,
}
"""The labels read from a pod (the API server bounds labels too, not their meaning)."""

POD_ANNOTATIONS: Mapping[str, ValueFormat] = {
    naming.SPEC_HASH_ANNOTATION: LABEL_VALUE,
    naming.KUEUE_TOTAL_COUNT_ANNOTATION: COUNT,
    naming.CONTAINER_ANNOTATION: DNS_LABEL,
    naming.RENDEZVOUS_ID_ANNOTATION: LABEL_VALUE,
    naming.RANK_ADDRESS_ANNOTATION: DNS_NAME,
    naming.DOMAIN_ANNOTATION: LABEL_VALUE,
    naming.SAVE_NOW_ANNOTATION: SAVE_NOW_TOKEN,
}
"""The annotations read from a pod: the API server bounds only their total (256 KiB)."""

OBJECT_ANNOTATIONS: Mapping[str, ValueFormat] = {
    naming.SPEC_HASH_ANNOTATION: LABEL_VALUE,
    naming.NODE_CAPACITY_ANNOTATION: ValueFormat(
        "a capacity stamp of at most 64 characters", re.compile(r"[-0-9A-Za-z_.]*(@[-0-9A-Za-z:.+]*)?"), 64
    ),
}
"""The annotations read from a Service or PodGroup (the operator writes them again when absent)."""


def _checked(values: Any, formats: Mapping[str, ValueFormat], ignored: list[str]) -> dict[str, str]:
    """The values of ``formats``' keys that have their format; the keys of the others in ``ignored``."""
    if not isinstance(values, Mapping):
        return {}
    found: dict[str, str] = {}
    for key, format_ in formats.items():
        value = values.get(key)
        if value is None:
            continue
        if format_.accepts(value):
            found[key] = value
        else:
            ignored.append(key)
    return found


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _time_or_none(value: Any) -> datetime | None:
    try:
        return parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _condition(conditions: Iterable[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def _main_container_status(pod: Mapping[str, Any], wanted: str | None) -> Mapping[str, Any]:
    statuses: list[Mapping[str, Any]] = pod.get("status", {}).get("containerStatuses") or []
    for status in statuses:
        if status.get("name") == wanted:
            return status
    return statuses[0] if statuses else {}


def _controller_name(metadata: Mapping[str, Any]) -> str | None:
    for reference in metadata.get("ownerReferences") or []:
        if reference.get("controller"):
            return str(reference.get("name", "")) or None
    return None


def _metrics_port(pod: Mapping[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == naming.METRICS_PORT_NAME:
                return _int_or_none(port.get("containerPort"))
    return None


def shared(value: str | None) -> str | None:
    """One copy of a string many records repeat (namespaces, owners, phases, nodes, reasons): a
    decoded body brings its own copy of each, kept as long as the record is."""
    return sys.intern(value) if isinstance(value, str) else value


def pod_record(pod: Mapping[str, Any]) -> PodRecord:
    """Project a Pod as the API returns it onto a PodRecord."""
    metadata = pod.get("metadata", {})
    ignored: list[str] = []
    labels = _checked(metadata.get("labels"), POD_LABELS, ignored)
    annotations = _checked(metadata.get("annotations"), POD_ANNOTATIONS, ignored)
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    container = _main_container_status(pod, annotations.get(naming.CONTAINER_ANNOTATION))
    state = container.get("state") or {}
    terminated = state.get("terminated") or {}
    waiting = state.get("waiting") or {}
    ready = _condition(conditions, "Ready")
    scheduled = _condition(conditions, "PodScheduled")
    disruption = _condition(conditions, "DisruptionTarget")
    unschedulable = scheduled is not None and scheduled.get("reason") == "Unschedulable"
    return PodRecord(
        name=metadata.get("name", ""),
        role=shared(labels.get(naming.ROLE_LABEL)) or "",
        index=_int_or_none(labels.get(naming.WORKER_INDEX_LABEL)),
        uid=metadata.get("uid", ""),
        namespace=shared(metadata.get("namespace")) or "",
        owner_name=shared(_controller_name(metadata)),
        attempt=_int_or_none(labels.get(naming.ATTEMPT_LABEL)),
        spec_hash=shared(annotations.get(naming.SPEC_HASH_ANNOTATION)),
        group_total=_int_or_none(annotations.get(naming.KUEUE_TOTAL_COUNT_ANNOTATION)),
        phase=shared(status.get("phase")) or "Pending",
        reason=shared(status.get("reason")),
        ready=ready is not None and ready.get("status") == "True",
        scheduled=scheduled is not None and scheduled.get("status") == "True",
        node_name=shared((pod.get("spec") or {}).get("nodeName")),
        pod_ip=status.get("podIP"),
        deleting=metadata.get("deletionTimestamp") is not None,
        created=_time_or_none(metadata.get("creationTimestamp")),
        exit_code=_int_or_none(terminated.get("exitCode")),
        terminated_reason=shared(terminated.get("reason")),
        termination_message=terminated.get("message"),
        waiting_reason=shared(waiting.get("reason")),
        waiting_message=waiting.get("message"),
        disruption_reason=(disruption or {}).get("reason") if (disruption or {}).get("status") == "True" else None,
        unschedulable_message=scheduled.get("message") if unschedulable and scheduled else None,
        metrics_port=_metrics_port(pod),
        host_network=bool((pod.get("spec") or {}).get("hostNetwork")),
        rendezvous_id=annotations.get(naming.RENDEZVOUS_ID_ANNOTATION),
        rank_address=annotations.get(naming.RANK_ADDRESS_ANNOTATION),
        domain=annotations.get(naming.DOMAIN_ANNOTATION),
        group_generation=_int_or_none(labels.get(naming.GROUP_GENERATION_LABEL)),
        save_now=annotations.get(naming.SAVE_NOW_ANNOTATION),
        ignored=tuple(ignored),
    )


def object_record(obj: Mapping[str, Any]) -> ObjectRecord:
    """Project a Service or PodGroup onto an ObjectRecord."""
    metadata = obj.get("metadata", {})
    annotations = _checked(metadata.get("annotations"), OBJECT_ANNOTATIONS, [])
    node_capacity = annotations.get(naming.NODE_CAPACITY_ANNOTATION)
    return ObjectRecord(
        kind=obj.get("kind", ""),
        name=metadata.get("name", ""),
        spec_hash=annotations.get(naming.SPEC_HASH_ANNOTATION),
        phase=(obj.get("status") or {}).get("phase"),
        uid=metadata.get("uid", ""),
        node_capacity=node_capacity,
        node_capacity_at=_time_or_none((node_capacity or "").partition("@")[2]),
    )


BOOST_ANNOTATION = "kueue.x-k8s.io/priority-boost"
"""Kueue's priority-boost annotation (v0.17, feature gate PriorityBoost): effective priority =
priority + this signed integer."""
MAX_BOOST_TEXT = 11


def queued_workload(obj: Mapping[str, Any]) -> QueuedWorkload:
    """Project a Kueue Workload (kueue.x-k8s.io/v1beta2) onto a QueuedWorkload."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    admitted = _condition(conditions, "Admitted") or {}
    reserved = _condition(conditions, "QuotaReserved") or {}
    evicted = _condition(conditions, "Evicted") or {}
    metadata = obj.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    boost = annotations.get(BOOST_ANNOTATION) if isinstance(annotations, Mapping) else None
    return QueuedWorkload(
        name=metadata.get("name", ""),
        admitted=admitted.get("status") == "True",
        message=str(reserved.get("message") or admitted.get("message") or ""),
        evicted=str(evicted.get("reason")) if evicted.get("status") == "True" else None,
        uid=str(metadata.get("uid") or ""),
        boost_text=(boost if len(boost) <= MAX_BOOST_TEXT else "") if isinstance(boost, str) else None,
        annotated=bool(annotations),
    )
