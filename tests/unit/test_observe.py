"""What a pass is given about one job (``cluster.observe``), and the records' times, parsed once."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from phalanx.cluster.cache import ChildCache, DeviceCache, NodeCache, NodeRequests, WorkloadCache
from phalanx.cluster.observe import node_capacity, observe_job
from phalanx.cluster.refusals import RefusalMemory
from phalanx.reconcile import naming
from phalanx.reconcile.observed import JobIsolation, NodeLoss, object_record, pod_record
from tests.unit import jobs

PARSED = jobs.job()
NAMESPACE, NAME, UID = PARSED.metadata.namespace, PARSED.metadata.name, PARSED.metadata.uid


def child(name: str, *, node: str | None = None, kind: str = "Pod", **metadata: Any) -> dict[str, Any]:
    owner = {"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob", "name": NAME, "uid": UID}
    return {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "labels": {naming.JOB_NAME_LABEL: NAME, naming.ROLE_LABEL: naming.ROLE_WORKER},
            "ownerReferences": [{**owner, "controller": True}],
            **metadata,
        },
        "spec": {
            "containers": [{"name": "w", "resources": {"requests": {"nvidia.com/gpu": "2"}}}],
            **({"nodeName": node} if node else {}),
        },
        "status": {"phase": "Running"},
    }


def node(name: str, gpus: int, *, ready: bool = True) -> dict[str, Any]:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    if not ready:
        condition["lastTransitionTime"] = "2026-12-01T10:00:00Z"
    return {
        "metadata": {"name": name, "labels": {"zone": "a"}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "conditions": [condition]},
    }


def test_a_job_with_nothing_but_its_children_observes_no_nodes() -> None:
    children = ChildCache()
    children.observe("ADDED", child("demo-worker-0"))
    observed = observe_job(PARSED, children)
    assert [pod.name for pod in observed.pods] == ["demo-worker-0"]
    assert observed.node_capacity == "" and observed.node_allocatable == {} and observed.node_labels == {}
    assert observed.node_requested == {} and observed.own_requested == {} and observed.unready_nodes == frozenset()
    assert observed.node_loss == NodeLoss() and observed.retry_batch == 1 and observed.refusals == {}
    assert observed.workload is None and observed.progress is None and observed.isolation is None


def test_a_job_observes_the_nodes_the_requests_the_refusals_and_the_settings() -> None:
    children, nodes, requests, refusals = ChildCache(), NodeCache(), NodeRequests(), RefusalMemory()
    ours = child("demo-worker-0", node="n1")
    children.observe("ADDED", ours)
    requests.observe("ADDED", ours)
    nodes.observe("ADDED", node("n1", 8))
    nodes.observe("ADDED", node("n2", 8, ready=False))
    now = datetime(2026, 12, 1, 11, tzinfo=UTC)
    refusals.record(UID, (NAMESPACE, NAME), ("Pod", "demo-worker-1"), "QuotaExceeded", "exceeded quota", now)
    isolation = JobIsolation()
    observed = observe_job(
        PARSED,
        children,
        nodes=nodes,
        devices=DeviceCache(),
        requests=requests,
        refusals=refusals,
        missing_apis={"scheduling.volcano.sh/v1beta1": "not installed"},
        isolation=isolation,
        node_lost_grace_seconds=60.0,
        force_delete_on_node_lost=True,
        spare_priority_class="phalanx-spare",
    )
    assert observed.node_capacity == nodes.capacity() != ""
    assert observed.node_allocatable == {"n1": {"nvidia.com/gpu": Decimal(8)}}
    assert set(observed.node_labels) == {"n1", "n2"}
    assert observed.own_requested == observed.node_requested == {"n1": {"nvidia.com/gpu": Decimal(2)}}
    assert observed.unready_nodes == {"n2"}
    assert observed.node_loss.unready_since == {"n2": datetime(2026, 12, 1, 10, tzinfo=UTC)}
    assert (observed.node_loss.grace_seconds, observed.node_loss.force_delete) == (60.0, True)
    assert set(observed.refusals) == {("Pod", "demo-worker-1")} and observed.retry_batch == 1
    assert observed.missing_apis == {"scheduling.volcano.sh/v1beta1": "not installed"}
    assert observed.isolation is isolation and observed.spare_priority_class == "phalanx-spare"


def test_only_a_kueue_job_observes_the_workload_of_its_current_pod_group() -> None:
    workloads = WorkloadCache()
    queued = jobs.job(gang={"scheduler": "kueue"})
    group = naming.kueue_group_name(NAME, queued.status.attempt)
    workloads.observe("ADDED", {"metadata": {"namespace": NAMESPACE, "name": group}, "status": {}})
    observed = observe_job(queued, ChildCache(), workloads=workloads)
    assert observed.workload is not None and observed.workload.name == group
    assert observe_job(PARSED, ChildCache(), workloads=workloads).workload is None


def test_the_capacity_fingerprint_counts_devices_only_beside_nodes() -> None:
    nodes, devices = NodeCache(), DeviceCache()
    assert node_capacity(nodes, devices) == ""
    nodes.observe("ADDED", node("n1", 8))
    assert node_capacity(nodes, devices) == nodes.capacity()  # no device published
    selector = {"cel": {"expression": 'device.driver == "gpu.example.com"'}}
    devices.observe(
        "ADDED",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "g"},
            "spec": {"selectors": [selector]},
        },
    )
    devices.observe(
        "ADDED",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "s"},
            "spec": {
                "driver": "gpu.example.com",
                "nodeName": "n1",
                "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0"}],
            },
        },
    )
    assert devices.fingerprint() != ""
    assert node_capacity(nodes, devices) not in ("", nodes.capacity())


def test_records_keep_times_as_datetimes() -> None:
    pod = pod_record(child("demo-worker-0", creationTimestamp="2026-12-01T10:00:00Z"))
    assert pod.created == datetime(2026, 12, 1, 10, tzinfo=UTC)
    assert pod_record(child("demo-worker-1")).created is None
    group = child("demo", kind="PodGroup")
    group["metadata"]["annotations"] = {naming.NODE_CAPACITY_ANNOTATION: "abc@2026-12-01T10:00:05Z"}
    stamped = object_record(group)
    assert stamped.node_capacity == "abc@2026-12-01T10:00:05Z"
    assert stamped.node_capacity_at == datetime(2026, 12, 1, 10, 0, 5, tzinfo=UTC)
    group["metadata"]["annotations"] = {naming.NODE_CAPACITY_ANNOTATION: "abc@not-a-time"}
    assert object_record(group).node_capacity_at is None
    group["metadata"]["annotations"] = {naming.NODE_CAPACITY_ANNOTATION: "abc"}
    assert object_record(group).node_capacity_at is None
