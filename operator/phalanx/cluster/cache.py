"""In-memory views of what the watches deliver: TrainingJobs, their children, unready nodes.

Children are kept as compact records (see ``reconcile.observed``), indexed by the job
they belong to, so a reconcile pass reads its observed state from memory instead of
listing pods from the API server. Responses to our own writes are fed in too, so the
next pass never acts on a view older than what it just did.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from phalanx.reconcile import naming
from phalanx.reconcile.observed import (
    ObjectRecord,
    Observed,
    PodRecord,
    WorkerProgress,
    object_record,
    pod_record,
)

JobKey = tuple[str, str]


def _resource_version(body: Mapping[str, Any]) -> int:
    try:
        return int(body.get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:  # resourceVersion is opaque; etcd's happen to be integers
        return 0


class JobCache:
    """The latest body of every TrainingJob, newest resourceVersion wins."""

    def __init__(self) -> None:
        self._bodies: dict[JobKey, dict[str, Any]] = {}

    def update(self, body: Mapping[str, Any]) -> JobKey:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        known = self._bodies.get(key)
        if (
            known is None
            or _resource_version(body) >= _resource_version(known)
            or known["metadata"].get("uid") != body["metadata"].get("uid")
        ):
            self._bodies[key] = dict(body)
        return key

    def forget(self, key: JobKey) -> None:
        self._bodies.pop(key, None)

    def get(self, key: JobKey) -> dict[str, Any] | None:
        return self._bodies.get(key)

    def keys(self) -> list[JobKey]:
        return list(self._bodies)


class ChildCache:
    """Compact records of pods, Services and PodGroups, by owning job."""

    def __init__(self) -> None:
        self._pods: dict[JobKey, dict[str, PodRecord]] = defaultdict(dict)
        self._objects: dict[JobKey, dict[tuple[str, str], ObjectRecord]] = defaultdict(dict)
        self._versions: dict[tuple[str, str, str], int] = {}

    @staticmethod
    def job_of(body: Mapping[str, Any]) -> JobKey | None:
        metadata = body.get("metadata", {})
        job = (metadata.get("labels") or {}).get(naming.JOB_NAME_LABEL)
        return (metadata.get("namespace", ""), job) if job else None

    def _fresh(self, body: Mapping[str, Any], deleted: bool) -> bool:
        metadata = body["metadata"]
        ident = (body.get("kind", ""), metadata.get("namespace", ""), metadata["name"])
        version = _resource_version(body)
        if deleted:
            self._versions.pop(ident, None)
            return True
        if version and version < self._versions.get(ident, 0):
            return False
        self._versions[ident] = version
        return True

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> JobKey | None:
        """Fold one watch event (or API response) in; returns the job it belongs to."""
        key = self.job_of(body)
        if key is None:
            return None
        deleted = event_type == "DELETED"
        if not self._fresh(body, deleted):
            return key
        name = body["metadata"]["name"]
        if body.get("kind", "Pod") == "Pod":
            if deleted:
                self._pods[key].pop(name, None)
            else:
                self._pods[key][name] = pod_record(body)
        else:
            ident = (body["kind"], name)
            if deleted:
                self._objects[key].pop(ident, None)
            else:
                self._objects[key][ident] = object_record(body)
        return key

    def forget(self, key: JobKey) -> None:
        self._pods.pop(key, None)
        self._objects.pop(key, None)

    def mark_deleting(self, key: JobKey, name: str) -> None:
        """Record our own deletion at once, so the next pass never counts the same failure twice
        while the watch's delete event is still on its way."""
        record = self._pods.get(key, {}).get(name)
        if record is not None and not record.deleting:
            self._pods[key][name] = dataclasses.replace(record, deleting=True)

    def jobs_on_node(self, node: str) -> list[JobKey]:
        return [key for key, pods in self._pods.items() if any(p.node_name == node for p in pods.values())]

    def observed(self, key: JobKey, unready_nodes: frozenset[str], progress: WorkerProgress | None = None) -> Observed:
        pods = tuple(sorted(self._pods.get(key, {}).values(), key=lambda pod: pod.name))
        return Observed(
            pods=pods, objects=dict(self._objects.get(key, {})), unready_nodes=unready_nodes, progress=progress
        )

    def pod_count(self) -> int:
        return sum(len(pods) for pods in self._pods.values())


class NodeCache:
    """Names of nodes whose Ready condition is not True."""

    def __init__(self) -> None:
        self._unready: set[str] = set()

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """Fold one node event in; True when the node's readiness changed."""
        name = body["metadata"]["name"]
        conditions = (body.get("status") or {}).get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        unready = event_type != "DELETED" and not ready
        before = name in self._unready
        if unready:
            self._unready.add(name)
        else:
            self._unready.discard(name)
        return before != unready or event_type == "DELETED"

    def unready(self) -> frozenset[str]:
        return frozenset(self._unready)
