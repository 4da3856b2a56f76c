"""An in-memory world for planner scenario tests: it stores what plans create and lets a test
play the kubelet's and the scheduler's part (schedule, run, fail, evict, lose a node).

This is not a stand-in for the API server in the operator's own tests of I/O (those run
against a real cluster); it exists so the pure planner can be driven through whole job
lifecycles in milliseconds, with pods in the exact JSON shape the API server returns.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from phalanx.api.v1alpha1 import TrainingJob
from phalanx.cluster.cache import NodeCache
from phalanx.cluster.observe import with_devices
from phalanx.reconcile import capacity, naming
from phalanx.reconcile.observed import (
    Completion,
    NodeLoss,
    Observed,
    QueuedWorkload,
    Refusal,
    ReportedProgress,
    WorkerProgress,
    child_kind,
    object_record,
    pod_record,
)
from phalanx.reconcile.plan import Plan, plan, status_changed
from phalanx.reconcile.status import format_time
from tests.unit import json_patch

START = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


@dataclass(frozen=True)
class View:
    """What a pass plans from: the job as read (at ``version``, its resourceVersion) and the
    children as observed. A view kept for later is a second replica's, or a cache that lags."""

    body: dict[str, Any]
    version: int
    observed: Observed


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386, as the API server applies the operator's status patches: null removes a key."""
    merged = dict(target)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_patch(merged[key], value)
        else:
            merged[key] = merge_patch({}, value) if isinstance(value, dict) else value
    return merged


class World:
    """The job, its children and the clock."""

    def __init__(self, job: TrainingJob, now: datetime = START) -> None:
        self.body: dict[str, Any] = job.model_dump(by_alias=True, exclude_none=True)
        self.body["status"] = job.status.model_dump(by_alias=True, exclude_none=True) if job.status.phase else {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.unready_nodes: set[str] = set()
        self.unready_since: dict[str, datetime] = {}  # NodeCache's record of when each went unready
        self.deleted_nodes: set[str] = set()
        self.node_loss = NodeLoss()  # the operator's node settings (grace, force)
        self.retry_batch = 1  # RefusalMemory.batch
        self.progress: WorkerProgress | None = None  # what the operator last scraped from a worker
        self.completion: Completion | None = None  # what the operator last read from the store
        self.reported: ReportedProgress | None = None  # rank 0's progress report, from the store
        self.refusals: dict[tuple[str, str], Refusal] = {}  # creations the API server refused, by (kind, name)
        self.foreign: set[tuple[str, str]] = set()  # names held by objects this job does not control
        self.missing_apis: dict[str, str] = {}
        self.node_capacity = ""  # the fingerprint of what the nodes offer (NodeCache.capacity)
        # each schedulable node's allocatable: by name, or a tuple (named node-0, node-1, ...)
        self.node_allocatable: tuple[dict[str, str], ...] | dict[str, dict[str, str]] = ()
        self.node_labels: dict[str, dict[str, str]] = {}  # node -> its labels
        # what other tenants' pods request on each node (the job's own pods are added from ``pods``)
        self.other_requests: dict[str, dict[str, str]] = {}
        # when set, the nodes' allocatable and labels come from it (fed with node bodies), not from above
        self.node_cache: NodeCache | None = None
        # each node's DRA devices per class (DeviceCache.per_node), beside its allocatable
        self.device_offers: Mapping[str, Mapping[str, Decimal]] = {}
        self.workload: QueuedWorkload | None = None  # what Kueue says about the current pod group
        self.spare_priority_class: str | None = None  # the operator's PHALANX_SPARE_PRIORITY_CLASS
        self.ledger_avoided: frozenset[str] = frozenset()  # nodes the cluster-wide node ledger avoids
        self._uids = itertools.count(1)
        self.now = now
        self.plans: list[Plan] = []
        self.job_deleted = False
        self.version = 1  # the job's resourceVersion: each status write moves it on

    # -- the operator's side ---------------------------------------------------------------------

    @property
    def job(self) -> TrainingJob:
        return TrainingJob.from_body(self.body)

    @property
    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.body["status"]
        return status

    def observed(self) -> Observed:
        pods = tuple(sorted((pod_record(pod) for pod in self.pods.values()), key=lambda p: p.name))
        objects = {key: object_record(obj) for key, obj in self.objects.items()}
        own: dict[str, dict[str, Decimal]] = {}
        for pod in self.pods.values():
            node = pod["spec"].get("nodeName")
            if node and pod["status"].get("phase") not in ("Succeeded", "Failed"):
                for name, value in capacity.pod_requests(pod["spec"]).items():
                    own.setdefault(node, {})[name] = own.get(node, {}).get(name, Decimal(0)) + value
        requested = {node: dict(held) for node, held in own.items()}
        for node, held in self.other_requests.items():
            for name, value in capacity.parse_allocatable(held).items():
                requested.setdefault(node, {})[name] = requested.get(node, {}).get(name, Decimal(0)) + value
        allocatable: Mapping[str, Mapping[str, Decimal]] = {
            name: capacity.parse_allocatable(node) for name, node in self.named_allocatable().items()
        }
        labels: Mapping[str, Mapping[str, str]] = self.node_labels
        if self.node_cache is not None:
            allocatable, labels = self.node_cache.allocatable(), self.node_cache.labels()
        return Observed(
            pods=pods,
            objects=objects,
            unready_nodes=frozenset(self.unready_nodes),
            progress=self.progress,
            completion=self.completion,
            reported=self.reported,
            foreign=frozenset(self.foreign),
            refusals=dict(self.refusals),
            missing_apis=dict(self.missing_apis),
            node_capacity=self.node_capacity,
            node_allocatable=with_devices(allocatable, self.device_offers),
            node_labels=labels,
            node_requested=requested,
            own_requested=own,
            workload=self.workload,
            node_loss=NodeLoss(
                unready_since={node: self.unready_since.get(node, self.now) for node in self.unready_nodes},
                deleted=frozenset(self.deleted_nodes),
                grace_seconds=self.node_loss.grace_seconds,
                force_delete=self.node_loss.force_delete,
            ),
            retry_batch=self.retry_batch,
            spare_priority_class=self.spare_priority_class,
            ledger_avoided=self.ledger_avoided,
        )

    def named_allocatable(self) -> dict[str, dict[str, str]]:
        if isinstance(self.node_allocatable, dict):
            return self.node_allocatable
        return {f"node-{index}": node for index, node in enumerate(self.node_allocatable)}

    def plan(self) -> Plan:
        return plan(self.job, self.observed(), self.now)

    def view(self, observed: Observed | None = None) -> View:
        """The job as it is now, with ``observed`` (children as a lagging cache saw them) or now's."""
        return View(copy.deepcopy(self.body), self.version, observed if observed is not None else self.observed())

    def plan_from(self, view: View) -> Plan:
        """A pass planned from ``view``, at this moment."""
        return plan(TrainingJob.from_body(view.body), view.observed, self.now)

    def reconcile(self) -> Plan:
        """Plan once and carry the plan out, as the operator would."""
        result = self.plan()
        self.carry_out(result)
        self.plans.append(result)
        return result

    def carry_out(self, result: Plan, *, stop_after_status: bool = False, view: View | None = None) -> bool:
        """What the operator's execution does; ``stop_after_status`` is a SIGKILL right after the
        status write (nothing else of the plan happens). ``view``: what the plan was made from
        (now's when None); its status write, sent when status changed or the plan promotes a spare,
        carries the view's resourceVersion, and a job written since refuses it (409): then nothing
        of the plan happens, and False is returned."""
        read = (view.body.get("status") or {}) if view is not None else self.status
        if result.status and (result.promotes or status_changed(read, result.status)):
            if view is not None and view.version != self.version:
                return False
            self.body["status"] = merge_patch(self.status, result.status)
            self.version += 1
        if stop_after_status:
            return True
        for applied in result.apply:
            obj = copy.deepcopy(applied)
            if obj["kind"] == "Pod" and obj["metadata"]["name"] in self.pods:
                continue  # a create of an existing pod answers 409
            obj["metadata"]["creationTimestamp"] = format_time(self.now)
            obj["metadata"]["uid"] = f"uid-{next(self._uids)}"
            if obj["kind"] == "Pod":
                obj["status"] = {"phase": "Pending"}
                self.pods[obj["metadata"]["name"]] = obj
            else:
                self.objects[(child_kind(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"])] = obj
        for patch in (*result.move, *result.address, *result.notices):
            self.patch_pod(patch.name, patch.body())
        for deletion in result.delete:
            if deletion.kind != "Pod":
                self.objects.pop((child_kind(deletion.api_version, deletion.kind), deletion.name), None)
                continue
            pod = self.pods.get(deletion.name)
            if pod is None:
                continue
            finished = pod["status"].get("phase") in ("Succeeded", "Failed")
            if deletion.grace_seconds == 0 or finished:
                del self.pods[deletion.name]
            else:
                pod["metadata"]["deletionTimestamp"] = format_time(self.now)
        if result.delete_job:
            self.job_deleted = True
        return True

    def patch_pod(self, name: str, operations: list[dict[str, Any]]) -> bool:
        """A JSON patch of a pod, as the API server applies it: all of it, or nothing when a test
        fails or the pod is gone (404, 422). False when it did not apply."""
        pod = self.pods.get(name)
        if pod is None:
            return False
        try:
            patched = json_patch.apply(pod, operations)
        except json_patch.PatchFailedError:
            return False
        pod.clear()
        pod.update(patched)  # the same dict: a test may hold it
        return True

    def settle(self, rounds: int = 10) -> Plan:
        """Reconcile until the plan changes nothing, letting terminating pods finish in between."""
        result = self.reconcile()
        for _ in range(rounds):
            self.finish_terminating()
            if not result.changes_children:
                return result
            result = self.reconcile()
        raise AssertionError(f"no fixed point after {rounds} rounds: {result}")

    # -- the cluster's side ----------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def finish_terminating(self) -> None:
        """The kubelet confirms graceful deletions (except on nodes that are not ready or gone)."""
        for name, pod in list(self.pods.items()):
            node = pod.get("spec", {}).get("nodeName")
            if pod["metadata"].get("deletionTimestamp") and node not in self.unready_nodes | self.deleted_nodes:
                del self.pods[name]

    def node_not_ready(self, node: str) -> None:
        """The node's Ready condition stops being True now (NodeCache remembers since when)."""
        self.unready_nodes.add(node)
        self.unready_since.setdefault(node, self.now)

    def node_ready(self, node: str) -> None:
        self.unready_nodes.discard(node)
        self.unready_since.pop(node, None)

    def lose_node(self, node: str) -> None:
        """The node is not ready and stays so past the operator's node-lost grace."""
        self.node_not_ready(node)
        self.advance(self.node_loss.grace_seconds)

    def workers(self, attempt: int | None = None) -> list[dict[str, Any]]:
        pods = [p for p in self.pods.values() if p["metadata"]["labels"][naming.ROLE_LABEL] == naming.ROLE_WORKER]
        if attempt is not None:
            pods = [p for p in pods if p["metadata"]["labels"][naming.ATTEMPT_LABEL] == str(attempt)]
        return sorted(pods, key=lambda p: p["metadata"]["name"])

    def spares(self) -> list[dict[str, Any]]:
        pods = [p for p in self.pods.values() if p["metadata"]["labels"][naming.ROLE_LABEL] == naming.ROLE_SPARE]
        return sorted(pods, key=lambda p: p["metadata"]["name"])

    def run(self, name: str | None = None, node: str = "node-a") -> None:
        """Schedule and start a pod (all pods when ``name`` is None): Running and Ready."""
        for pod_name in [name] if name else list(self.pods):
            pod = self.pods[pod_name]
            if pod["status"].get("phase") in ("Succeeded", "Failed") or pod["metadata"].get("deletionTimestamp"):
                continue
            pod["spec"]["nodeName"] = pod["spec"].get("nodeName") or node
            pod["status"] = {
                "phase": "Running",
                "podIP": "10.0.0.1",
                "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
                "containerStatuses": [
                    {
                        "name": pod["spec"]["containers"][0]["name"],
                        "state": {"running": {"startedAt": format_time(self.now)}},
                    }
                ],
            }

    def schedule_only(self, name: str, node: str = "node-a") -> None:
        pod = self.pods[name]
        pod["spec"]["nodeName"] = node
        pod["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}

    def unschedulable(self, name: str, message: str) -> None:
        self.pods[name]["status"] = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
        }

    def terminate(
        self, name: str, exit_code: int, reason: str = "Error", message: str | None = None, *, terminal: bool = True
    ) -> None:
        """The main container exited; ``terminal=False`` is the kubelet's status before it marks the
        pod Succeeded or Failed (phase still Running, Ready already False)."""
        pod = self.pods[name]
        terminated: dict[str, Any] = {"exitCode": exit_code, "reason": reason}
        if message:
            terminated["message"] = message
        pod["status"] = {
            "phase": ("Succeeded" if exit_code == 0 else "Failed") if terminal else "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}],
            "containerStatuses": [{"name": pod["spec"]["containers"][0]["name"], "state": {"terminated": terminated}}],
        }

    def waiting(self, name: str, reason: str, message: str = "") -> None:
        pod = self.pods[name]
        pod["status"] = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {
                    "name": pod["spec"]["containers"][0]["name"],
                    "state": {"waiting": {"reason": reason, "message": message}},
                }
            ],
        }

    def disrupt(self, name: str, reason: str = "EvictionByEvictionAPI") -> None:
        pod = self.pods[name]
        pod["status"].setdefault("conditions", []).append(
            {"type": "DisruptionTarget", "status": "True", "reason": reason}
        )
        pod["status"]["phase"] = "Failed"

    def delete_pod(self, name: str) -> None:
        """Someone deleted the pod outright (kubectl delete pod --force)."""
        self.pods.pop(name, None)


def running(world: World) -> World:
    """The world with the job's store and workers created and running, the job Running."""
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running", world.status
    return world
