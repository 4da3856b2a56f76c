"""DRA devices on the real control plane: KWOK nodes whose GPUs and NICs this module publishes as
ResourceSlices (a driver name of its own) with DeviceClasses selecting them; the real scheduler
allocates each worker's claim, made by the real resource claim controller from the job's
ResourceClaimTemplate, under the chart's RBAC."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest

from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import TRAINER
from tests.integration.test_operator import create, describe, job_status, wait_phase, workers

pytestmark = pytest.mark.integration

GPU_DRIVER = "gpu.dra.phalanx.dev"
NIC_DRIVER = "nic.dra.phalanx.dev"
GPU_CLASS = "gpu.dra.phalanx.dev"
NIC_CLASS = "nic.dra.phalanx.dev"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
POOL = {"phalanx.dev/pool": "devices"}
GPUS_PER_NODE = 4
NODES = 3
ROOTS = ("pci0000:00", "pci0000:80")  # two GPUs and one NIC on each


def gpu(index: int) -> dict[str, Any]:
    return {
        "name": f"gpu-{index}",
        "attributes": {
            "model": {"string": "H100"},
            "index": {"int": index},
            PCIE_ROOT: {"string": ROOTS[index // 2]},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }


def nic(index: int) -> dict[str, Any]:
    return {"name": f"nic-{index}", "attributes": {"rdma": {"bool": True}, PCIE_ROOT: {"string": ROOTS[index]}}}


def resource_slice(node: str, driver: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver.split('.', maxsplit=1)[0]}", "labels": {"phalanx.dev/test": "devices"}},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def device_class(name: str, driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name, "labels": {"phalanx.dev/test": "devices"}},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


@pytest.fixture(scope="module")
def dra_nodes(kwok_cluster: Any, kubectl: Kubectl) -> Iterator[list[str]]:
    """Three KWOK nodes with no GPU extended resource: four GPUs and two RDMA NICs each, published
    as ResourceSlices, and the two DeviceClasses; removed after the module."""
    nodes = list(kwok_cluster.add_gpu_nodes(NODES, gpus_per_node=0, labels=POOL, name_prefix="dra-"))
    objects = [device_class(GPU_CLASS, GPU_DRIVER), device_class(NIC_CLASS, NIC_DRIVER)]
    for node in nodes:
        objects.append(resource_slice(node, GPU_DRIVER, [gpu(i) for i in range(GPUS_PER_NODE)]))
        objects.append(resource_slice(node, NIC_DRIVER, [nic(i) for i in range(2)]))
    kubectl.apply(objects)
    try:
        yield nodes
    finally:
        for obj in objects:
            with contextlib.suppress(Exception):
                kubectl.delete(f"{obj['kind'].lower()}s.resource.k8s.io", obj["metadata"]["name"], wait=False)
        for node in nodes:
            with contextlib.suppress(Exception):
                kubectl.delete("node", node, wait=False)


def dra_job(gpus: int, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "workers": {"min": 2, "max": 3, "desired": 2},
        "gpus": {
            "count": gpus,
            "deviceClassName": GPU_CLASS,
            "selectors": ['device.attributes["gpu.dra.phalanx.dev"].model == "H100"'],
        },
        "template": {"spec": {"nodeSelector": POOL, "containers": [TRAINER]}},
    }
    spec.update(copy.deepcopy(extra))
    return spec


def claim_of(kubectl: Kubectl, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    """The ResourceClaim the resource claim controller made for the pod's ``devices`` claim."""
    statuses = pod["status"].get("resourceClaimStatuses") or []
    name = next(s["resourceClaimName"] for s in statuses if s["name"] == naming.DEVICE_CLAIM)
    claim = kubectl.get("resourceclaims.resource.k8s.io", name, namespace)
    assert claim is not None
    return claim


def allocated(claim: dict[str, Any]) -> list[dict[str, Any]]:
    return list(((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or [])


def test_each_worker_gets_the_dra_gpus_the_scheduler_allocates_from_the_jobs_template(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, dra_nodes: list[str]
) -> None:
    create(kubectl, namespace, **dra_job(2))
    status = wait_phase(kubectl, namespace, "Running", timeout=90)
    assert status["workerSummary"] == "2/2"
    job = kubectl.get("tj", "demo", namespace)
    assert job is not None
    template = kubectl.get("resourceclaimtemplates.resource.k8s.io", "demo-devices", namespace)
    assert template is not None
    assert template["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    for pod in workers(kubectl, namespace):
        assert pod["spec"]["resourceClaims"] == [{"name": "devices", "resourceClaimTemplateName": "demo-devices"}]
        claim = claim_of(kubectl, namespace, pod)
        assert claim["metadata"]["ownerReferences"][0]["name"] == pod["metadata"]["name"]  # goes with its pod
        assert claim["metadata"]["labels"][naming.JOB_NAME_LABEL] == "demo"
        results = allocated(claim)
        assert len(results) == 2, claim
        assert {(r["driver"], r["pool"]) for r in results} == {(GPU_DRIVER, pod["spec"]["nodeName"])}
        reserved = [entry["name"] for entry in claim["status"].get("reservedFor") or []]
        assert reserved == [pod["metadata"]["name"]]
    # the pods go with the job, and their claims with them
    kubectl.delete("tj", "demo", namespace)
    kubectl.wait_for(
        lambda: not kubectl.list("resourceclaims.resource.k8s.io", namespace),
        timeout=60,
        what="claims removed with the pods",
    )


def test_a_nic_per_gpu_is_allocated_on_its_gpus_pcie_root(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, dra_nodes: list[str]
) -> None:
    rdma = {"deviceClassName": NIC_CLASS, "count": 2, "matchAttribute": PCIE_ROOT}
    create(kubectl, namespace, **dra_job(2, workers={"min": 1, "max": 1, "desired": 1}, network={"rdma": rdma}))
    wait_phase(kubectl, namespace, "Running", timeout=90)
    (pod,) = workers(kubectl, namespace)
    results = {r["request"]: r["device"] for r in allocated(claim_of(kubectl, namespace, pod))}
    assert set(results) == {"gpus-0", "nics-0", "gpus-1", "nics-1"}, results
    root = {f"gpu-{i}": ROOTS[i // 2] for i in range(GPUS_PER_NODE)} | {f"nic-{i}": ROOTS[i] for i in range(2)}
    for pair in ("0", "1"):
        assert root[results[f"gpus-{pair}"]] == root[results[f"nics-{pair}"]], results
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["NCCL_NET"] == "IB"  # the NICs make the transport InfiniBand/RoCE, strict


def test_more_dra_gpus_than_any_node_publishes_stall_the_job_in_the_schedulers_words(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, dra_nodes: list[str]
) -> None:
    create(kubectl, namespace, **dra_job(GPUS_PER_NODE + 1))
    status = kubectl.wait_for(
        lambda: (s := job_status(kubectl, namespace)).get("reason") == "InsufficientCapacity" and s,
        timeout=90,
        what=lambda: f"InsufficientCapacity; now:\n{describe(kubectl, namespace)}",
    )
    assert isinstance(status, dict)
    assert status["phase"] == "Pending"
    assert "cannot allocate all claims" in status["message"], status["message"]  # the scheduler's words
    assert f"{GPUS_PER_NODE + 1} device(s) of class {GPU_CLASS}" in status["message"], status["message"]
    stalled = {c["type"]: c for c in status["conditions"]}["Stalled"]
    assert stalled["status"] == "True" and stalled["reason"] == "InsufficientCapacity"
