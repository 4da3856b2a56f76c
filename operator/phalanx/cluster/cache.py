"""In-memory views of what the informers deliver: TrainingJobs, their children, the nodes, the DRA
devices drivers publish, Kueue's Workloads.

Children are kept as compact records (see ``reconcile.observed``), indexed by the UID of the
TrainingJob that controls them (their controller owner reference), never by name: a job deleted
and created again under the same name must not see its predecessor's pods as its own. Objects that
carry a job's name label but belong to another owner are kept too, as *foreign*: they block the
names the job needs, and the planner says so instead of taking them over.

Each cache is an informer sink: a list replaces everything of its kind and scope (so deletions a
watch missed during a gap disappear), single events update one object. Responses to our own
writes are fed in as well, so the next pass never acts on a view older than what it just did; an
object in the cache newer than a list's resourceVersion (one we created after the list's
snapshot) survives that list, and a response that arrives after the object's DELETED event does
not bring it back (``RecentlyDeleted``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import MappingProxyType
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import capacity, naming
from phalanx.reconcile.actions import Event
from phalanx.reconcile.observed import (
    POD_ANNOTATIONS,
    POD_LABELS,
    ChildKey,
    ObjectRecord,
    PodRecord,
    QueuedWorkload,
    child_kind,
    object_record,
    pod_record,
    queued_workload,
    shared,
)

JobKey = tuple[str, str]
ObjectKey = tuple[str, str, str]  # child kind, namespace, name


def resource_version(body: Mapping[str, Any]) -> int:
    """etcd's resourceVersions are integers; the API calls them opaque, so treat others as 0."""
    try:
        return int(body.get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:
        return 0


def _list_version(version: str) -> int | None:
    """The list's snapshot version; None means "nothing exists" (an API that is not served)."""
    try:
        return int(version) if version else None
    except ValueError:
        return 0


def controller_of(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, uid) of the TrainingJob that controls this object, if one does."""
    for reference in body.get("metadata", {}).get("ownerReferences") or []:
        if (
            reference.get("controller")
            and reference.get("kind") == api.KIND
            and reference.get("apiVersion", "").startswith(f"{api.GROUP}/")
        ):
            return str(reference.get("name", "")), str(reference.get("uid", ""))
    return None


KEPT_METADATA_VALUE = 1024  # the longest label or annotation value a slimmed body keeps


def _kept(values: Any, keys: tuple[str, ...]) -> dict[str, Any] | None:
    if not isinstance(values, Mapping):
        return None
    return {k: v for k in keys if isinstance(v := values.get(k), str) and len(v) <= KEPT_METADATA_VALUE} or None


KEPT_ANNOTATIONS = (*api.GITOPS_ANNOTATIONS, naming.SAVE_NOW_ANNOTATION)
"""The job's annotations the planner reads: ``ObjectMeta.gitops_tool``'s and the save-now token."""


def _slim(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body without what the operator never reads and what grows with every write (the field
    managers' bookkeeping, kubectl's copy of the last applied manifest, and every label and
    annotation but the few ``ObjectMeta.gitops_tool`` and ``reconcile.save_now`` read: their values
    are the tenant's), its keys and short strings shared with every other job's (each decoded body
    brings its own copies)."""
    given = body.get("metadata") or {}
    metadata = {k: v for k, v in given.items() if k not in ("managedFields", "labels", "annotations")}
    for field, keys in (("labels", api.GITOPS_LABELS), ("annotations", KEPT_ANNOTATIONS)):
        if (kept := _kept(given.get(field), keys)) is not None:
            metadata[field] = kept
    save_now = (given.get("annotations") or {}).get(naming.SAVE_NOW_ANNOTATION)
    if isinstance(save_now, str) and len(save_now) > KEPT_METADATA_VALUE:
        # its head is enough to be refused as no token, with a message that quotes it
        metadata.setdefault("annotations", {})[naming.SAVE_NOW_ANNOTATION] = save_now[:KEPT_METADATA_VALUE]
    slimmed: dict[str, Any] = _shared_strings({**body, "metadata": metadata})
    return slimmed


SHARED_STRING_LENGTH = 64  # longer ones (messages, commands) rarely repeat


def _shared_strings(value: Any) -> Any:
    if isinstance(value, dict):
        return {sys.intern(k): _shared_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shared_strings(item) for item in value]
    if isinstance(value, str) and len(value) <= SHARED_STRING_LENGTH:
        return sys.intern(value)
    return value


class RecentlyDeleted:
    """UIDs of the objects whose deletion was seen in the last ``seconds``: a response to one of
    our writes, folded in after the watch delivered the object's DELETED event, must not bring the
    object back. Kept for a while, not for ever, so it holds what a minute's deletions need and
    never grows with the jobs a process has seen; a UID is never reused."""

    def __init__(self, seconds: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._order: deque[tuple[float, str]] = deque()
        self._uids: set[str] = set()
        self._seconds = seconds
        self._clock = clock

    def add(self, uid: str) -> None:
        now = self._clock()
        self._expire(now)
        if uid and uid not in self._uids:
            self._order.append((now, uid))
            self._uids.add(uid)

    def _expire(self, now: float) -> None:
        while self._order and self._order[0][0] <= now - self._seconds:
            self._uids.discard(self._order.popleft()[1])

    def __contains__(self, uid: object) -> bool:
        if self._order:
            self._expire(self._clock())
        return uid in self._uids


def _uid(body: Mapping[str, Any]) -> str:
    return str((body.get("metadata") or {}).get("uid") or "")


class ListedSink:
    """An informer's sink: single events (``observe``) and, after a list whose items were each
    folded in as they came (page by page, so no list is ever held whole), what the list lacks
    (``retain``)."""

    def observe(self, event_type: str, obj: Mapping[str, Any], /) -> object:
        raise NotImplementedError

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str, /) -> None:
        """Everything of ``kind`` in ``namespace`` (None: everywhere) as of ``version`` is ``listed``
        ((namespace, name); namespace "" for cluster-scoped kinds): the rest is gone. An empty
        ``version`` means the resource is not there at all."""
        raise NotImplementedError

    def replace(self, kind: str, namespace: str | None, objects: list[dict[str, Any]], version: str) -> None:
        """A whole list at once."""
        for obj in objects:
            self.observe("ADDED", {"kind": kind.partition(".")[0], **obj})
        listed = {(obj["metadata"].get("namespace", ""), obj["metadata"]["name"]) for obj in objects}
        self.retain(kind, namespace, listed, version)


class JobCache(ListedSink):
    """The latest body of every TrainingJob, newest resourceVersion wins (slimmed: ``_slim``).

    ``on_change(key, gone)`` is called for every change; ``gone`` when the job no longer exists.
    """

    def __init__(self, on_change: Callable[[JobKey, bool], None] | None = None) -> None:
        self._bodies: dict[JobKey, dict[str, Any]] = {}
        self._on_change = on_change

    def _notify(self, key: JobKey, gone: bool) -> None:
        if self._on_change is not None:
            self._on_change(key, gone)

    def update(self, body: Mapping[str, Any]) -> JobKey:
        """Fold in a body from a watch or a list unless ours is newer."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        known = self._bodies.get(key)
        if (
            known is None
            or resource_version(body) >= resource_version(known)
            or known["metadata"].get("uid") != body["metadata"].get("uid")
        ):
            self._bodies[key] = _slim(body)
        return key

    def answered(self, body: Mapping[str, Any]) -> None:
        """Fold in the API server's answer to our write (or read) of a job, if the job is still
        here: one whose DELETED event came first must not come back."""
        known = self._bodies.get((body["metadata"]["namespace"], body["metadata"]["name"]))
        if known is not None and _uid(known) == _uid(body):
            self.update(body)

    def observe(self, event_type: str, obj: Mapping[str, Any]) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if event_type == "DELETED":
            known = self._bodies.get(key)
            if known is not None and known["metadata"].get("uid") == obj["metadata"].get("uid"):
                self.forget(key)
                self._notify(key, True)
            return
        self.update(obj)
        self._notify(key, False)

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str) -> None:
        snapshot = _list_version(version)
        for key, body in list(self._bodies.items()):
            in_scope = namespace is None or key[0] == namespace
            newer = snapshot is not None and resource_version(body) > snapshot
            if in_scope and key not in listed and not newer:
                self.forget(key)
                self._notify(key, True)

    def forget(self, key: JobKey) -> None:
        self._bodies.pop(key, None)

    def deleted(self, key: JobKey, uid: str) -> None:
        """We deleted this job (its TTL ran out): act as on its DELETED event, so passes woken by
        its pods going away meanwhile do not delete it again."""
        known = self._bodies.get(key)
        if known is not None and known["metadata"].get("uid") == uid:
            self.forget(key)
            self._notify(key, True)

    def get(self, key: JobKey) -> dict[str, Any] | None:
        return self._bodies.get(key)

    def keys(self) -> list[JobKey]:
        return list(self._bodies)


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where one child is filed: its controller (if any) and the job name it is labelled with."""

    owner_uid: str | None
    owner_name: str | None
    job_label: str | None
    version: int


OwnerKey = tuple[str, str]  # namespace, UID of the controlling TrainingJob


class ChildCache(ListedSink):
    """Compact records of pods, Services and PodGroups, by the namespace and UID of the job that
    controls them, and by ``child_kind`` (both gang schedulers' PodGroups are called PodGroup).

    A child is read only in its own namespace: an owner reference names no namespace, so a pod
    elsewhere that names a job's UID is never taken for one of the job's (nor can it replace one).

    ``on_change(key)`` names the job (namespace, name) whose children changed; ``on_pod_gone``
    the namespace of a pod that no longer exists.
    """

    def __init__(
        self,
        on_change: Callable[[JobKey], None] | None = None,
        on_pod_gone: Callable[[str], None] | None = None,
    ) -> None:
        self._pods: dict[OwnerKey, dict[str, PodRecord]] = defaultdict(dict)
        self._objects: dict[OwnerKey, dict[ChildKey, ObjectRecord]] = defaultdict(dict)
        self._entries: dict[ObjectKey, _Entry] = {}
        self._labelled: dict[JobKey, set[ChildKey]] = defaultdict(set)
        self._waiting: dict[ObjectKey, JobKey] = {}  # pods the scheduler found no node for, by job
        self._deleted = RecentlyDeleted()
        self._warned: dict[ObjectKey, tuple[str, frozenset[str]]] = {}  # pod UID, keys warned of
        self._on_change = on_change
        self._on_pod_gone = on_pod_gone

    # -- feeding --------------------------------------------------------------------------------

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> JobKey | None:
        """Fold one watch event (or API response) in; returns the job it concerns."""
        metadata = body.get("metadata", {})
        kind = shared(child_kind(body.get("apiVersion") or "v1", body.get("kind") or "Pod")) or ""
        ident = (kind, shared(metadata.get("namespace", "")) or "", metadata.get("name", ""))
        if event_type == "DELETED":
            self._deleted.add(_uid(body))
            return self._remove(ident)
        if _uid(body) in self._deleted:
            return None  # our write's response, folded in after the object's DELETED event
        version = resource_version(body)
        known = self._entries.get(ident)
        if known is not None and version and version < known.version:
            return self._job_of(ident[1], known)  # an older event arrived late
        owner = controller_of(body)
        label = (metadata.get("labels") or {}).get(naming.JOB_NAME_LABEL)
        if known is not None:
            self._unfile(ident, known)
        entry = _Entry(shared(owner[1]) if owner else None, shared(owner[0]) if owner else None, shared(label), version)
        self._entries[ident] = entry
        if label:
            self._labelled[(ident[1], label)].add((kind, ident[2]))
        if entry.owner_uid:
            owner_key = (ident[1], entry.owner_uid)
            if kind == "Pod":
                record = pod_record(body)
                self._pods[owner_key][ident[2]] = record
                if record.unschedulable_message and record.owner_name and not record.deleting:
                    self._waiting[ident] = (record.namespace, record.owner_name)
            else:
                self._objects[owner_key][(kind, ident[2])] = object_record(body)
        key = self._job_of(ident[1], entry)
        self._notify(key)
        return key

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str) -> None:
        """A complete list of ``kind`` (a ``child_kind``) in ``namespace`` (None: everywhere) as of
        ``version`` named ``listed`` (namespace, name), each folded in already: what it lacks is
        gone, unless the cache holds it at a newer version (created after the list's snapshot).
        Other kinds, the other gang scheduler's PodGroups among them, are left alone."""
        snapshot = _list_version(version)
        for ident, entry in list(self._entries.items()):
            if ident[0] != kind or (namespace is not None and ident[1] != namespace) or ident[1:] in listed:
                continue
            if snapshot is None or entry.version <= snapshot:
                self._remove(ident)

    def _remove(self, ident: ObjectKey) -> JobKey | None:
        entry = self._entries.pop(ident, None)
        self._warned.pop(ident, None)
        if entry is None:
            return None
        self._unfile(ident, entry)
        key = self._job_of(ident[1], entry)
        self._notify(key)
        if ident[0] == "Pod" and self._on_pod_gone is not None:
            self._on_pod_gone(ident[1])
        return key

    def _unfile(self, ident: ObjectKey, entry: _Entry) -> None:
        kind, namespace, name = ident
        self._waiting.pop(ident, None)
        if entry.job_label:
            names = self._labelled.get((namespace, entry.job_label))
            if names is not None:
                names.discard((kind, name))
                if not names:
                    del self._labelled[(namespace, entry.job_label)]
        if entry.owner_uid:
            owner_key = (namespace, entry.owner_uid)
            table: dict[Any, Any] = self._pods if kind == "Pod" else self._objects
            records = table.get(owner_key)
            if records is not None:
                records.pop(name if kind == "Pod" else (kind, name), None)
                if not records:
                    del table[owner_key]

    @staticmethod
    def _job_of(namespace: str, entry: _Entry) -> JobKey | None:
        name = entry.owner_name or entry.job_label
        return (namespace, name) if name else None

    def _notify(self, key: JobKey | None) -> None:
        if key is not None and self._on_change is not None:
            self._on_change(key)

    def mark_deleting(self, namespace: str, owner_uid: str, name: str) -> None:
        """Record our own deletion at once, so the next pass does not delete it again while the
        watch's event is still on its way (counting is by UID and does not depend on this)."""
        pods = self._pods.get((namespace, owner_uid), {})
        record = pods.get(name)
        if record is not None and not record.deleting:
            pods[name] = dataclasses.replace(record, deleting=True)
            self._waiting.pop(("Pod", namespace, name), None)

    def take_ignored_values(self, namespace: str, job_uid: str) -> tuple[Event, ...]:
        """A Warning Event for each label or annotation value of the job's pods that was ignored
        (``PodRecord.ignored``) and not reported yet: once per pod UID and key, for as long as
        the pod is cached."""
        found: list[Event] = []
        for name, record in self._pods.get((namespace, job_uid), {}).items():
            if not record.ignored:
                continue
            ident = ("Pod", namespace, name)
            uid, warned = self._warned.get(ident, (record.uid, frozenset()))
            if uid != record.uid:
                warned = frozenset()
            for key in record.ignored:
                if key in warned:
                    continue
                kind, format_ = (
                    ("label", POD_LABELS[key]) if key in POD_LABELS else ("annotation", POD_ANNOTATIONS[key])
                )
                found.append(
                    Event(
                        "Warning",
                        "PodValueIgnored",
                        f"pod {name}: the value of its {kind} {key} is ignored (read as absent): "
                        f"it must be {format_.what}",
                    )
                )
            self._warned[ident] = (record.uid, warned | frozenset(record.ignored))
        return tuple(found)

    # -- reading ---------------------------------------------------------------------------------

    def foreign(self, namespace: str, job_name: str, job_uid: str) -> frozenset[ChildKey]:
        """(child kind, name) of objects labelled with this job's name that this job does not control."""
        names = self._labelled.get((namespace, job_name), set())
        return frozenset(
            (kind, name)
            for kind, name in names
            if (entry := self._entries.get((kind, namespace, name))) is not None and entry.owner_uid != job_uid
        )

    def jobs_on_node(self, node: str) -> list[JobKey]:
        found = []
        for pods in self._pods.values():
            for pod in pods.values():
                if pod.node_name == node and pod.owner_name:
                    found.append((pod.namespace, pod.owner_name))
                    break
        return found

    def jobs_waiting_for_nodes(self) -> set[JobKey]:
        """Jobs with a worker the scheduler found no node for (kept as pods change: a pod that
        goes away asks this, so it must not walk every pod)."""
        return set(self._waiting.values())

    def objects_of(self, namespace: str, job_uid: str) -> dict[ChildKey, ObjectRecord]:
        """Services and PodGroups the job controls, by (child kind, name)."""
        return dict(self._objects.get((namespace, job_uid), {}))

    def pods_of(self, namespace: str, job_uid: str) -> tuple[PodRecord, ...]:
        return tuple(sorted(self._pods.get((namespace, job_uid), {}).values(), key=lambda pod: pod.name))

    def pod_count(self) -> int:
        return len([ident for ident in self._entries if ident[0] == "Pod"])


class NodeCache(ListedSink):
    """Nodes whose Ready condition is not True and since when, nodes recently deleted, every
    node's labels, and what the schedulable nodes offer (their allocatable and a fingerprint).

    Since when a node is not ready: its Ready condition's ``lastTransitionTime`` (never later than
    when this process first saw it so), kept while the node stays not ready. A timestamp the cluster
    holds, not this process's memory, so an operator restart or a leader change does not start the
    node-lost grace again and two replicas agree; the node lifecycle controller writes it when it
    marks a silent node Unknown. A later flip between False and Unknown moves the condition's time
    but not this one.

    ``on_change(name)`` is called when a node's readiness changed or it was deleted;
    ``on_capacity()`` when what a schedulable node offers changed (a node came, went, became Ready
    or schedulable, lost a taint, changed its allocatable) or a pod freed what it held.
    """

    DELETED_MEMORY = timedelta(hours=1)
    """How long a deleted node is remembered: longer than the pod garbage collector takes to remove
    the pods bound to it."""

    def __init__(
        self,
        on_change: Callable[[str], None] | None = None,
        on_capacity: Callable[[], None] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._unready: dict[str, datetime] = {}  # node -> since when it is not Ready
        self._deleted: dict[str, datetime] = {}  # node -> when its deletion was seen
        self._known: set[str] = set()
        self._offers: dict[str, str] = {}  # schedulable node -> what it offers
        # schedulable node -> its allocatable as listed, and parsed (once per change)
        self._allocatable: dict[str, tuple[Mapping[str, Any], Mapping[str, Decimal]]] = {}
        self._allocatable_view: Mapping[str, Mapping[str, Decimal]] | None = None
        self._labels: dict[str, dict[str, str]] = {}  # every existing node -> its labels (topology domains)
        self._labels_view: Mapping[str, Mapping[str, str]] | None = None
        # XOR of one digest per (node, offer): updated per node event, independent of order, so
        # the fingerprint costs O(1) however many nodes there are
        self._offer_digest = 0
        self._released = 0  # pods that went away (their node's resources are free again)
        self._fingerprint: str | None = None
        self._on_change = on_change
        self._on_capacity = on_capacity
        self._clock = clock

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Fold one node event in; True when the node's readiness changed."""
        name = body["metadata"]["name"]
        conditions = (body.get("status") or {}).get("conditions") or []
        condition = next((c for c in conditions if c.get("type") == "Ready"), None)
        ready = condition is not None and condition.get("status") == "True"
        deleted = event_type == "DELETED"
        unready = not deleted and not ready
        before = name in self._unready
        now = self._clock()
        if unready:
            if not before:
                self._unready[name] = _unready_since(condition, now)
        else:
            self._unready.pop(name, None)
        if deleted:
            self._known.discard(name)
            self._deleted[name] = now
        else:
            self._known.add(name)
            self._deleted.pop(name, None)
        self._observe_offer(name, None if deleted or unready else _offer(body))
        if name in self._offers:
            allocatable = (body.get("status") or {}).get("allocatable") or {}
            known = self._allocatable.get(name)
            if known is None or known[0] != allocatable:
                self._allocatable[name] = (dict(allocatable), capacity.parse_allocatable(allocatable))
                self._allocatable_view = None
        elif self._allocatable.pop(name, None) is not None:
            self._allocatable_view = None
        # every node's labels while it exists, Ready or not, cordoned or not: they say where pods
        # run (their domain, their rank address), which a NotReady blip or a cordon does not change
        labels = body.get("metadata", {}).get("labels") or {}
        if deleted:
            if self._labels.pop(name, None) is not None:
                self._labels_view = None
        elif self._labels.get(name) != labels:
            self._labels[name] = {shared(key) or "": shared(value) or "" for key, value in labels.items()}
            self._labels_view = None
        changed = before != unready or deleted
        if changed and self._on_change is not None:
            self._on_change(name)
        return changed

    def _observe_offer(self, name: str, offer: str | None) -> None:
        before = self._offers.get(name)
        if before == offer:
            return
        if before is not None:
            self._offer_digest ^= _offer_digest(name, before)
        if offer is None:
            del self._offers[name]
        else:
            self._offers[name] = offer
            self._offer_digest ^= _offer_digest(name, offer)
        self._fingerprint = None
        if self._on_capacity is not None:
            self._on_capacity()

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str) -> None:
        if not version:  # nodes may not be listed any more: unknown, which is not deleted
            for name in list(self._known):
                self._forget(name)
            return
        for name in self._known - {name for _, name in listed}:
            self.observe("DELETED", {"metadata": {"name": name}})

    def _forget(self, name: str) -> None:
        """Drop what is known of a node without taking it for deleted."""
        self._known.discard(name)
        was_unready = self._unready.pop(name, None) is not None
        self._observe_offer(name, None)
        if self._allocatable.pop(name, None) is not None:
            self._allocatable_view = None
        if self._labels.pop(name, None) is not None:
            self._labels_view = None
        if was_unready and self._on_change is not None:
            self._on_change(name)

    def unready(self) -> frozenset[str]:
        return frozenset(self._unready)

    def unready_since(self) -> dict[str, datetime]:
        """Node -> since when it has not been Ready."""
        return dict(self._unready)

    def deleted(self) -> frozenset[str]:
        """Nodes deleted in the last ``DELETED_MEMORY`` (and not back since)."""
        if self._deleted:
            oldest = self._clock() - self.DELETED_MEMORY
            for name in [name for name, when in self._deleted.items() if when < oldest]:
                del self._deleted[name]
        return frozenset(self._deleted)

    def allocatable(self) -> Mapping[str, Mapping[str, Decimal]]:
        """Node name -> what each schedulable node can give pods in all, in base units (rebuilt
        only when a node changed; read-only)."""
        if self._allocatable_view is None:
            self._allocatable_view = MappingProxyType({name: parsed for name, (_, parsed) in self._allocatable.items()})
        return self._allocatable_view

    def labels(self) -> Mapping[str, Mapping[str, str]]:
        """Node name -> the labels of every node that exists, schedulable or not (read-only):
        where pods run is not whether new ones may go there (``allocatable`` says that)."""
        if self._labels_view is None:
            self._labels_view = MappingProxyType(dict(self._labels))
        return self._labels_view

    def pod_released(self) -> None:
        """A pod went away: what it held on its node is free again."""
        self._released += 1
        self._fingerprint = None
        if self._on_capacity is not None:
            self._on_capacity()

    def capacity(self) -> str:
        """A short digest of what the schedulable nodes offer and of the pods that freed some of it
        ("" when no node is known)."""
        if self._fingerprint is None:
            listing = f"{self._offer_digest:032x}/{self._released}"
            self._fingerprint = hashlib.sha256(listing.encode()).hexdigest()[:16] if self._offers else ""
        return self._fingerprint


Requests = tuple[tuple[str, Decimal], ...]
"""What one pod requests of its node, by resource (``capacity.pod_requests``), sorted."""


class NodeRequests(ListedSink):
    """What the pods bound to each node request, pods of every namespace and owner (other
    tenants' included): a node's room is its allocatable less this (``Observed.node_free``).

    Fed by a cluster-wide informer on the pods that have a node and have not finished (a field
    selector, so finished pods never cross the wire); a pod that finishes or goes is dropped. Per
    pod it keeps its node and its requests (one shared tuple per distinct set, as pods of one
    template ask alike), and each node's sum is updated per event, so nothing is summed per pass.

    ``on_release()`` is called when a pod stops holding what it requested (deleted, finished).
    """

    def __init__(self, on_release: Callable[[], None] | None = None) -> None:
        self._pods: dict[tuple[str, str], tuple[str, Requests]] = {}  # (namespace, name) -> (node, requests)
        self._shared: dict[Requests, tuple[Requests, int]] = {}  # requests -> (one copy, pods holding it)
        self._totals: dict[str, dict[str, Decimal]] = {}  # node -> what its pods request (replaced, never changed)
        self._counts: dict[str, int] = {}  # node -> its pods
        self._view: Mapping[str, Mapping[str, Decimal]] | None = None
        self._on_release = on_release

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        metadata = body.get("metadata") or {}
        key = (shared(metadata.get("namespace", "")) or "", str(metadata.get("name", "")))
        spec = body.get("spec") or {}
        node = spec.get("nodeName")
        phase = (body.get("status") or {}).get("phase")
        if event_type == "DELETED" or not node or phase in ("Succeeded", "Failed"):
            if self._drop(key) and self._on_release is not None:
                self._on_release()
            return
        try:
            parsed = capacity.pod_requests(spec)
        except ValueError:  # the API server validates quantities: not expected
            parsed = {}
        requests = tuple(sorted((sys.intern(name), value) for name, value in parsed.items() if value > 0))
        if self._pods.get(key) == (node, requests):
            return
        self._drop(key)
        copy, holders = self._shared.get(requests, (requests, 0))
        self._shared[requests] = (copy, holders + 1)
        node = shared(node) or ""
        self._pods[key] = (node, copy)
        self._count(node, copy, 1)

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str) -> None:
        released = False
        for key in [key for key in self._pods if namespace in (None, key[0]) and key not in listed]:
            released = self._drop(key) or released
        if released and self._on_release is not None:
            self._on_release()

    def _drop(self, key: tuple[str, str]) -> bool:
        held = self._pods.pop(key, None)
        if held is None:
            return False
        node, requests = held
        copy, holders = self._shared[requests]
        if holders > 1:
            self._shared[requests] = (copy, holders - 1)
        else:
            del self._shared[requests]
        self._count(node, requests, -1)
        return True

    def _count(self, node: str, requests: Requests, sign: int) -> None:
        pods = self._counts.get(node, 0) + sign
        if pods:
            total = dict(self._totals.get(node, {}))  # a new dict: views handed out never change
            for name, value in requests:
                total[name] = total.get(name, Decimal(0)) + sign * value
            self._totals[node] = total
            self._counts[node] = pods
        else:
            self._totals.pop(node, None)
            self._counts.pop(node, None)
        self._view = None

    def requested(self) -> Mapping[str, Mapping[str, Decimal]]:
        """Node -> what the pods bound to it request (rebuilt only after a change; read-only)."""
        if self._view is None:
            self._view = MappingProxyType(dict(self._totals))
        return self._view

    def held_by(self, pods: Iterable[tuple[str, str]]) -> dict[str, dict[str, Decimal]]:
        """Node -> what these pods ((namespace, name)) bound to it request."""
        held: dict[str, dict[str, Decimal]] = {}
        for key in pods:
            known = self._pods.get(key)
            if known is not None:
                total = held.setdefault(known[0], {})
                for name, value in known[1]:
                    total[name] = total.get(name, Decimal(0)) + value
        return held


def _unready_since(condition: Mapping[str, Any] | None, now: datetime) -> datetime:
    """When a node's Ready condition last changed (see ``NodeCache``), never later than ``now``."""
    stamp = str((condition or {}).get("lastTransitionTime") or "")
    try:
        since = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return now
    return min(since, now) if since.tzinfo is not None else now


def _offer_digest(name: str, offer: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{name}\0{offer}".encode()).digest()[:16], "big")


def _offer(node: Mapping[str, Any]) -> str | None:
    """What a Ready node offers pods, as a stable string; None when it takes no new pods."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return None
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    taints = sorted(
        f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}"
        for t in spec.get("taints") or []
        if t.get("effect") in ("NoSchedule", "NoExecute")
    )
    labels = sorted(((node.get("metadata") or {}).get("labels") or {}).items())  # topology domains
    return json.dumps([sorted(allocatable.items()), taints, labels], separators=(",", ":"))


class DeviceCache(ListedSink):
    """What DRA drivers publish, for the capacity judgement: a compact record of each ResourceSlice
    and the driver each DeviceClass selects (``capacity.class_driver``).

    ``on_capacity()`` is called when the devices a class offers may have changed.
    """

    SLICE = child_kind("resource.k8s.io/v1", "ResourceSlice")
    CLASS = child_kind("resource.k8s.io/v1", "DeviceClass")

    def __init__(self, on_capacity: Callable[[], None] | None = None) -> None:
        self._slices: dict[str, capacity.SliceRecord] = {}
        self._drivers: dict[str, str | None] = {}  # DeviceClass -> the driver it selects
        self._view: Mapping[str, Mapping[str, Decimal]] | None = None
        self._fingerprint: str | None = None
        self._on_capacity = on_capacity

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Fold one event in; True when what it says of devices changed."""
        name = str(body.get("metadata", {}).get("name", ""))
        kind = child_kind(str(body.get("apiVersion") or ""), str(body.get("kind") or ""))
        gone = event_type == "DELETED"
        if kind == self.SLICE:
            changed = self._set(self._slices, name, None if gone else capacity.slice_record(body))
        elif kind == self.CLASS:
            if gone:
                changed = self._drivers.pop(name, "-") != "-"
            else:
                driver = capacity.class_driver(body)
                changed = name not in self._drivers or self._drivers[name] != driver
                self._drivers[name] = driver
        else:
            return False
        if changed:
            self._changed()
        return changed

    @staticmethod
    def _set(records: dict[str, capacity.SliceRecord], name: str, record: capacity.SliceRecord | None) -> bool:
        if record is None:
            return records.pop(name, None) is not None
        if records.get(name) == record:
            return False
        records[name] = record
        return True

    def _changed(self) -> None:
        self._view = None
        self._fingerprint = None
        if self._on_capacity is not None:
            self._on_capacity()

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str) -> None:
        names = {name for _, name in listed} if version else set()
        known: dict[str, Any] = self._slices if kind == self.SLICE else self._drivers
        stale = [name for name in known if name not in names]
        for name in stale:
            del known[name]
        if stale:
            self._changed()

    def per_node(self) -> Mapping[str, Mapping[str, Decimal]]:
        """Node -> DRA devices per DeviceClass on it (``capacity.devices_per_node``; read-only)."""
        if self._view is None:
            self._view = MappingProxyType(capacity.devices_per_node(self._slices.values(), self._drivers))
        return self._view

    def fingerprint(self) -> str:
        """A short digest of the devices on offer ("" when none is known)."""
        if self._fingerprint is None:
            offers = sorted((node, sorted(per_class.items())) for node, per_class in self.per_node().items())
            listing = json.dumps(offers, default=str, separators=(",", ":"))
            self._fingerprint = hashlib.sha256(listing.encode()).hexdigest()[:16] if offers else ""
        return self._fingerprint


class WorkloadCache(ListedSink):
    """Kueue's Workloads of pod groups, by namespace and name.

    ``on_change(namespace, name)`` is called when one came, changed or went.
    """

    def __init__(self, on_change: Callable[[str, str], None] | None = None) -> None:
        self._workloads: dict[tuple[str, str], QueuedWorkload] = {}
        self._on_change = on_change

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        metadata = body["metadata"]
        key = (metadata.get("namespace", ""), metadata["name"])
        before = self._workloads.get(key)
        if event_type == "DELETED":
            self._workloads.pop(key, None)
        else:
            self._workloads[key] = queued_workload(body)
        if self._workloads.get(key) != before and self._on_change is not None:
            self._on_change(*key)

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str) -> None:
        for key in [k for k in self._workloads if namespace in (None, k[0]) and k not in listed]:
            self.observe("DELETED", {"metadata": {"namespace": key[0], "name": key[1]}})

    def get(self, namespace: str, name: str) -> QueuedWorkload | None:
        return self._workloads.get((namespace, name))
