"""DRA devices for workers: the claim template a job owns, its pods' claims, the capacity judgement
over what drivers publish in ResourceSlices, and the planner waiting for what it needs."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from phalanx.cli.plan import summary
from phalanx.cluster.cache import DeviceCache
from phalanx.cluster.observe import with_devices
from phalanx.reconcile import capacity, desired, naming
from phalanx.reconcile.environment import resolve_launch
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.preview import preview
from tests.unit.crd_validation import defaulted
from tests.unit.jobs import job, manifest
from tests.unit.simulation import World

GPU_CLASS = "gpu.example.com"
NIC_CLASS = "rdma.example.com"
DRA_GPUS = {"count": 2, "deviceClassName": GPU_CLASS}
TEMPLATE = ("ResourceClaimTemplate.resource.k8s.io", naming.device_claim_template_name("demo"))


def requests_of(template: dict[str, Any]) -> list[tuple[str, str, int]]:
    return [
        (request["name"], request["exactly"]["deviceClassName"], request["exactly"]["count"])
        for request in template["spec"]["spec"]["devices"]["requests"]
    ]


def test_device_plugin_gpus_stay_extended_resources_with_their_toleration() -> None:
    parsed = job(gpus={"count": 2})
    pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=0, attempt=0)
    assert desired.device_claim_template(parsed) is None
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert "resourceClaims" not in pod["spec"]


def test_dra_gpus_become_a_claim_per_worker_from_the_jobs_template() -> None:
    parsed = job(gpus={**DRA_GPUS, "selectors": ['device.attributes["gpu.example.com"].model == "H100"']})
    template = desired.device_claim_template(parsed)
    assert template is not None
    assert template["metadata"]["name"] == "demo-devices"
    assert template["metadata"]["ownerReferences"][0]["uid"] == parsed.metadata.uid
    assert template["spec"]["metadata"]["labels"][naming.JOB_NAME_LABEL] == "demo"  # claims carry the job
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request == {
        "name": "gpus",
        "exactly": {
            "deviceClassName": GPU_CLASS,
            "allocationMode": "ExactCount",
            "count": 2,
            "selectors": [{"cel": {"expression": 'device.attributes["gpu.example.com"].model == "H100"'}}],
        },
    }
    launch = resolve_launch(parsed.spec)
    assert (launch.backend, launch.procs_per_worker) == ("nccl", 2)  # GPUs all the same
    pod = desired.worker_pod(parsed, launch, index=0, attempt=0)
    assert pod["spec"]["resourceClaims"] == [{"name": "devices", "resourceClaimTemplateName": "demo-devices"}]
    trainer = pod["spec"]["containers"][0]
    assert trainer["resources"]["claims"] == [{"name": "devices"}]
    assert "nvidia.com/gpu" not in trainer["resources"]["limits"]
    assert "tolerations" not in pod["spec"]  # no device plugin's taint to tolerate
    store = desired.rendezvous_store_pod(parsed, launch)
    assert "resourceClaims" not in store["spec"]  # the store holds no devices


def test_a_nic_per_gpu_is_paired_on_the_matched_attribute() -> None:
    parsed = job(
        gpus={"count": 2, "deviceClassName": GPU_CLASS},
        network={
            "rdma": {"deviceClassName": NIC_CLASS, "count": 2, "matchAttribute": "resource.kubernetes.io/pcieRoot"}
        },
    )
    template = desired.device_claim_template(parsed)
    assert template is not None
    assert requests_of(template) == [
        ("gpus-0", GPU_CLASS, 1),
        ("nics-0", NIC_CLASS, 1),
        ("gpus-1", GPU_CLASS, 1),
        ("nics-1", NIC_CLASS, 1),
    ]
    assert template["spec"]["spec"]["devices"]["constraints"] == [
        {"requests": ["gpus-0", "nics-0"], "matchAttribute": "resource.kubernetes.io/pcieRoot"},
        {"requests": ["gpus-1", "nics-1"], "matchAttribute": "resource.kubernetes.io/pcieRoot"},
    ]
    launch = resolve_launch(parsed.spec)
    assert launch.transport == "infiniband"
    limits = desired.worker_pod(parsed, launch, index=0, attempt=0)["spec"]["containers"][0]["resources"]["limits"]
    assert not [name for name in limits if "/" in name]  # no extended resources: all through the claim


def test_fewer_nics_than_gpus_share_the_attribute_with_all_of_them() -> None:
    parsed = job(
        gpus={"count": 4, "deviceClassName": GPU_CLASS},
        network={"rdma": {"deviceClassName": NIC_CLASS, "matchAttribute": "example.com/switch"}},
    )
    template = desired.device_claim_template(parsed)
    assert template is not None
    assert requests_of(template) == [("gpus", GPU_CLASS, 4), ("nics", NIC_CLASS, 1)]
    assert template["spec"]["spec"]["devices"]["constraints"] == [
        {"requests": ["gpus", "nics"], "matchAttribute": "example.com/switch"}
    ]


def test_a_dra_nic_beside_device_plugin_gpus() -> None:
    parsed = job(gpus={"count": 8}, network={"rdma": {"deviceClassName": NIC_CLASS}})
    template = desired.device_claim_template(parsed)
    assert template is not None and requests_of(template) == [("nics", NIC_CLASS, 1)]
    pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=0, attempt=0)
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "demo-devices"


def test_the_templates_own_claims_are_kept_beside_the_jobs_and_a_clash_is_named() -> None:
    compute_domain = {"name": "imex", "resourceClaimTemplateName": "domain-channel"}
    parsed = job(gpus=DRA_GPUS, template={"spec": {"resourceClaims": [compute_domain]}})
    pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=0, attempt=0)
    assert pod["spec"]["resourceClaims"] == [
        compute_domain,
        {"name": "devices", "resourceClaimTemplateName": "demo-devices"},
    ]
    clash = job(gpus=DRA_GPUS, template={"spec": {"resourceClaims": [{"name": "devices", "resourceClaimName": "x"}]}})
    with pytest.raises(PlanningError, match=r"spec.template.spec.resourceClaims.*the job's own"):
        desired.worker_pod(clash, resolve_launch(clash.spec), index=0, attempt=0)


def test_the_claim_template_comes_first_and_workers_wait_for_it() -> None:
    world = World(job(gpus=DRA_GPUS))
    first = world.plan()
    assert [obj["kind"] for obj in first.apply] == ["ResourceClaimTemplate", "Service", "Pod"]
    world.carry_out(first)
    del world.objects[TEMPLATE]  # its creation did not land (refused, or the pass was cut short)
    held = world.reconcile()
    assert [obj["kind"] for obj in held.apply] == ["ResourceClaimTemplate"]
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "WaitingForDeviceClaims")
    workers = world.reconcile()
    assert [obj["metadata"]["name"] for obj in workers.apply] == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert not world.reconcile().apply  # created once: never applied over


def test_a_cluster_without_dra_says_so_and_creates_nothing() -> None:
    world = World(job(gpus=DRA_GPUS))
    world.missing_apis = {desired.RESOURCE_API: "not served by the API server"}
    result = world.reconcile()
    assert result.apply == ()
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "DevicesUnavailable")
    assert "Kubernetes 1.34" in world.status["message"] and "not served" in world.status["message"]
    stalled = {c["type"]: c for c in world.status["conditions"]}["Stalled"]
    assert stalled["status"] == "True"


def slice_body(name: str, node: str | None, driver: str, devices: int, generation: int = 1) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": node or "fabric", "generation": generation, "resourceSliceCount": 1},
        "devices": [{"name": f"d{index}"} for index in range(devices)],
    }
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}


def class_body(name: str, expression: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


@pytest.mark.parametrize(
    ("expression", "driver"),
    [
        ('device.driver == "gpu.example.com"', "gpu.example.com"),
        ("device.driver == 'gpu.example.com'", "gpu.example.com"),
        ('device.driver.startsWith("gpu")', None),  # the scheduler's to evaluate: no judgement
    ],
)
def test_a_device_class_is_judged_only_by_the_driver_it_names(expression: str, driver: str | None) -> None:
    assert capacity.class_driver(class_body("c", expression)) == driver


def test_devices_per_node_count_a_pools_newest_generation_and_leave_unbound_drivers_out() -> None:
    slices = [
        capacity.slice_record(slice_body("a-old", "node-a", "gpu.example.com", 8, generation=1)),
        capacity.slice_record(slice_body("a-new", "node-a", "gpu.example.com", 4, generation=2)),
        capacity.slice_record(slice_body("b", "node-b", "gpu.example.com", 8)),
        capacity.slice_record(slice_body("c", "node-c", "nic.example.com", 2)),
        capacity.slice_record(slice_body("fabric", None, "nic.example.com", 64)),
    ]
    offers = capacity.devices_per_node(slices, {"gpus": "gpu.example.com", "nics": "nic.example.com", "odd": None})
    key = capacity.device_class_resource("gpus")
    # node-c lists no GPUs: the judgement counts a node without the key as offering none
    assert offers == {"node-a": {key: Decimal(4)}, "node-b": {key: Decimal(8)}}


def test_insufficient_capacity_reads_devices_from_resource_slices() -> None:
    cache = DeviceCache()
    cache.observe("ADDED", class_body(GPU_CLASS, 'device.driver == "gpu.example.com"'))
    for node in ("node-0", "node-1"):
        cache.observe("ADDED", slice_body(f"{node}-gpus", node, "gpu.example.com", 2))
    nodes = {"node-0": {"cpu": Decimal(64)}, "node-1": {"cpu": Decimal(64)}, "node-2": {"cpu": Decimal(64)}}
    merged = with_devices(nodes, cache.per_node())
    four = job(gpus={"count": 4, "deviceClassName": GPU_CLASS})
    per_worker = desired.worker_demand(four, resolve_launch(four.spec))
    assert per_worker[capacity.device_class_resource(GPU_CLASS)] == Decimal(4)
    why = capacity.shortfall(per_worker, tuple(merged.values()), 1)
    assert why is not None and f"4 device(s) of class {GPU_CLASS}" in why

    world = World(job(gpus=DRA_GPUS))
    world.node_allocatable = {name: {"cpu": "64", "memory": "256Gi"} for name in nodes}
    world.device_offers = cache.per_node()
    world.settle()
    world.unschedulable("demo-worker-0", "0/3 nodes are available: 3 cannot allocate all claims.")
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "InsufficientCapacity")
    assert "can hold at most 2 worker(s)" in world.status["message"]
    assert "cannot allocate all claims" in world.status["message"]  # the scheduler's own words
    # the driver publishes a third node's GPUs: possible again, waiting rather than stalled
    cache.observe("ADDED", slice_body("node-2-gpus", "node-2", "gpu.example.com", 2))
    world.device_offers = cache.per_node()
    world.reconcile()
    assert world.status["reason"] == "Unschedulable"


def test_the_device_cache_forgets_what_a_list_no_longer_names_and_says_when_offers_change() -> None:
    changes: list[int] = []
    cache = DeviceCache(on_capacity=lambda: changes.append(1))
    cache.observe("ADDED", class_body(GPU_CLASS, 'device.driver == "gpu.example.com"'))
    cache.observe("ADDED", slice_body("s", "node-0", "gpu.example.com", 2))
    before = cache.fingerprint()
    assert before and len(changes) == 2
    cache.observe("MODIFIED", slice_body("s", "node-0", "gpu.example.com", 2))  # nothing new
    assert len(changes) == 2
    cache.retain(DeviceCache.SLICE, None, set(), "42")  # the list names no slice any more
    assert cache.per_node() == {} and cache.fingerprint() == "" and len(changes) == 3
    assert with_devices({"node-0": {"cpu": Decimal(1)}}, cache.per_node()) == {"node-0": {"cpu": Decimal(1)}}


def test_phalanx_plan_shows_the_claim_template() -> None:
    body = manifest(
        gpus={"count": 8, "deviceClassName": GPU_CLASS},
        network={
            "rdma": {"deviceClassName": NIC_CLASS, "count": 8, "matchAttribute": "resource.kubernetes.io/pcieRoot"}
        },
    )
    result = preview(defaulted(body))
    assert result.objects[0]["kind"] == "ResourceClaimTemplate"
    text = summary(result)
    assert "8 x DRA devices of class gpu.example.com per worker" in text
    assert "ResourceClaimTemplate demo-devices (resource.k8s.io/v1): one claim per worker pod" in text
    assert (
        "8 pairs of (1 x gpu.example.com) and (1 x rdma.example.com), each pair sharing resource.kubernetes.io/pcieRoot"
        in text
    )
    assert "DRA claim devices" in text
