"""Every example plans into the objects its comment promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from phalanx.reconcile import naming
from tests.unit.crd_validation import defaulted
from tests.unit.jobs import job
from tests.unit.simulation import World

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> dict[str, Any]:
    body = yaml.safe_load((EXAMPLES / name).read_text())
    body["metadata"].update(namespace="ml", uid="0f0f0f0f-0000-0000-0000-000000000000", generation=1)
    return defaulted(body)


def first_worker(name: str) -> tuple[World, dict[str, Any]]:
    world = World(job(load(name)))
    world.reconcile()
    if not world.workers():
        world.reconcile()
    return world, world.workers()[0]


def env(pod: dict[str, Any]) -> dict[str, str]:
    trainer = next(
        c for c in pod["spec"]["containers"] if c["name"] == pod["metadata"]["annotations"][naming.CONTAINER_ANNOTATION]
    )
    return {var["name"]: var.get("value", "") for var in trainer["env"]}


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_plans_its_desired_workers(example: str) -> None:
    world, _ = first_worker(example)
    spec = world.job.spec
    assert len(world.workers()) == spec.workers.desired
    assert ("Service", f"{world.job.metadata.name}-rdzv") in world.objects


def test_cpu_example_uses_gloo_without_nccl() -> None:
    _, pod = first_worker("cpu-gloo.yaml")
    variables = env(pod)
    assert variables["PHALANX_BACKEND"] == "gloo"
    assert variables["GLOO_SOCKET_IFNAME"] == "eth0"
    assert variables["OMP_NUM_THREADS"] == "1"
    assert not [name for name in variables if "NCCL" in name]


def test_single_node_gpu_example_runs_eight_processes_over_nccl() -> None:
    _, pod = first_worker("single-node-multi-gpu.yaml")
    variables = env(pod)
    assert variables["PET_NPROC_PER_NODE"] == "8"
    assert variables["NCCL_NET"] == "Socket" and variables["NCCL_IB_DISABLE"] == "1"
    assert variables["PHALANX_CHECKPOINT_DIR"] == "/checkpoints"
    assert variables["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith("/checkpoints/")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "phalanx-dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_infiniband_example_is_strict_about_the_fabric() -> None:
    _, pod = first_worker("multi-node-infiniband.yaml")
    variables = env(pod)
    assert variables["NCCL_NET"] == "IB" and variables["NCCL_IB_DISABLE"] == "0"
    assert variables["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1,mlx5_2,mlx5_3"
    assert variables["NCCL_SOCKET_IFNAME"] == "=eth0"
    assert variables["NCCL_DEBUG"] == "INFO"  # the user's override wins
    assert "NCCL_IB_GID_INDEX" not in variables
    trainer = pod["spec"]["containers"][0]
    assert trainer["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert trainer["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    assert trainer["resources"]["requests"]["rdma/rdma_shared_device_a"] == "1"
    assert pod["metadata"]["annotations"][naming.MULTUS_ANNOTATION] == "ml/ib-net"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]


def test_coscheduling_example_creates_a_podgroup_and_labels_pods() -> None:
    world, pod = first_worker("gang-scheduler-plugins.yaml")
    group = world.objects[("PodGroup.scheduling.x-k8s.io", "gang-coscheduling")]
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"]["minMember"] == 2
    assert group["spec"]["scheduleTimeoutSeconds"] == 120
    assert group["spec"]["minResources"]["nvidia.com/gpu"] == "8"
    assert pod["metadata"]["labels"][naming.COSCHEDULING_POD_GROUP_LABEL] == "gang-coscheduling"
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"


def test_volcano_example_creates_a_podgroup_and_annotates_pods() -> None:
    world, pod = first_worker("gang-volcano.yaml")
    group = world.objects[("PodGroup.scheduling.volcano.sh", "gang-volcano")]
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"]["queue"] == "research"
    assert group["spec"]["priorityClassName"] == "research-normal"
    assert pod["metadata"]["annotations"][naming.VOLCANO_GROUP_ANNOTATION] == "gang-volcano"
    assert pod["spec"]["schedulerName"] == "volcano"


def test_kueue_example_labels_every_pod_of_the_attempt() -> None:
    world, _ = first_worker("gang-kueue.yaml")
    assert not [key for key in world.objects if key[0].startswith("PodGroup.")]
    for pod in world.workers():
        assert pod["metadata"]["labels"][naming.KUEUE_QUEUE_LABEL] == "team-a"
        assert pod["metadata"]["labels"][naming.KUEUE_POD_GROUP_LABEL] == "gang-kueue-a0"
        assert pod["metadata"]["annotations"][naming.KUEUE_TOTAL_COUNT_ANNOTATION] == "4"
        assert "schedulerName" not in pod["spec"]


def test_static_example_gives_every_worker_kubeflows_variables() -> None:
    world, _ = first_worker("static-python.yaml")
    assert ("Service", "static-python-workers") in world.objects
    for index, pod in enumerate(world.workers()):
        variables = env(pod)
        assert variables["MASTER_ADDR"] == "static-python-worker-0.static-python-workers.ml.svc"
        assert variables["MASTER_PORT"] == "29400"
        assert (variables["WORLD_SIZE"], variables["RANK"]) == ("4", str(index))
        assert (variables["PET_NNODES"], variables["PET_NODE_RANK"]) == ("4", str(index))
        assert "PET_RDZV_ENDPOINT" not in variables and variables["PET_MAX_RESTARTS"] == "0"
        assert variables["PHALANX_STORE_ENDPOINT"] == "static-python-rdzv.ml.svc:29400"
        assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (
            f"static-python-worker-{index}",
            "static-python-workers",
        )


def test_in_place_example_runs_the_supervisor_with_the_attempt_read_from_the_pod() -> None:
    world, pod = first_worker("in-place-restart.yaml")
    variables = env(pod)
    assert world.status["restartMode"] == "InPlace"
    assert "PHALANX_ATTEMPT" not in variables and "PET_RDZV_ID" not in variables
    assert variables["PHALANX_STOP_GRACE_SECONDS"] == "120"
    assert "keep_alive_interval=2," in variables["PET_RDZV_CONF"]
    assert any(volume["name"] == naming.POD_INFO_VOLUME for volume in pod["spec"]["volumes"])
