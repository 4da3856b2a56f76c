"""Bad nodes avoided (failurePolicy.avoidNodeSeconds): a worker that failed for a cause of its node's
own keeps the job's later pods off that node for a while; status says which and until when, and a job
that the avoidance leaves without room says so."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from phalanx.reconcile import desired, naming
from phalanx.reconcile.failures import node_error
from phalanx.reconcile.status import format_time
from tests.unit.jobs import job
from tests.unit.simulation import START, World
from tests.unit.test_plan import running_with_worker_2_on_node_b


def kept_off(pod: dict[str, Any]) -> list[list[str]]:
    """The node names each required node selector term of the pod keeps off."""
    affinity = (pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}
    terms = (affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    return [
        [name for field in term.get("matchFields", []) if field["operator"] == "NotIn" for name in field["values"]]
        for term in terms
    ]


def conditions(world: World) -> dict[str, str]:
    return {c["type"]: c["status"] for c in world.status["conditions"]}


def test_a_lost_nodes_replacement_worker_keeps_off_it_until_the_time_is_up() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.deleted_nodes.add("node-b")
    plan = world.reconcile()
    until = format_time(world.now + timedelta(seconds=3600))
    assert world.status["avoidedNodes"] == [
        {"node": "node-b", "reason": "NodeLost", "message": world.status["avoidedNodes"][0]["message"], "until": until}
    ]
    assert "which was deleted" in world.status["avoidedNodes"][0]["message"]
    avoiding = [e for e in plan.events if e.reason == "AvoidingNode"]
    assert len(avoiding) == 1 and f"keep off node node-b until {until} (NodeLost)" in avoiding[0].message
    replacement = world.reconcile()
    [worker] = [obj for obj in replacement.apply if obj["metadata"]["name"] == "demo-worker-2"]
    assert kept_off(worker) == [["node-b"]]
    assert not [e for e in replacement.events if e.reason == "AvoidingNode"]  # said once
    assert world.status["avoidedNodes"][0]["until"] == until  # recorded once, not pushed back each pass
    assert replacement.requeue_after is not None and replacement.requeue_after <= 3600

    world.run()
    world.advance(3600)
    world.reconcile()
    assert "avoidedNodes" not in world.status  # its time is up
    world.delete_pod("demo-worker-1")  # deleted from outside: not the node's fault
    world.settle()
    fresh = world.pods["demo-worker-1"]
    assert kept_off(fresh) == [] and world.status["restarts"] == 0


@pytest.mark.parametrize(
    ("message", "fault"),
    [
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "GPUError"),
        ("NVML_ERROR_GPU_IS_LOST while reading utilisation", "GPUError"),
        ("Xid 79: GPU has fallen off the bus", "GPUError"),
        (
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
            "NCCLError",
        ),
        ("NET/IB : Got completion from peer 10.0.0.2 with error 12, opcode 0", "NCCLError"),
        ('{"message": {"message": "RuntimeError: ncclSystemError: System call failed"}}', "NCCLError"),
        ("ValueError: shapes do not match", None),
        ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7)", None),  # names no node
        ("torch.OutOfMemoryError: CUDA out of memory", None),
        (None, None),
    ],
)
def test_gpu_and_fabric_errors_in_the_termination_message_blame_the_node(
    message: str | None, fault: str | None
) -> None:
    assert node_error(message) == fault


def test_a_worker_that_died_of_a_gpu_error_is_counted_and_its_node_avoided() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.terminate("demo-worker-2", 1, message="RuntimeError: CUDA error: uncorrectable ECC error encountered")
    world.reconcile()
    assert (world.status["restarts"], world.status["restartsByReason"]) == (1, {"WorkerFailed": 1})
    assert [(e["node"], e["reason"]) for e in world.status["avoidedNodes"]] == [("node-b", "GPUError")]
    world.settle()
    assert kept_off(world.pods["demo-worker-2"]) == [["node-b"]]


def test_an_application_error_or_a_node_shutdown_avoids_no_node_and_0_seconds_turns_it_off() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.terminate("demo-worker-2", 1, message="ValueError: shapes do not match")
    world.settle()
    assert "avoidedNodes" not in world.status and kept_off(world.pods["demo-worker-2"]) == []
    world.run()
    world.reconcile()
    pod = world.pods["demo-worker-1"]
    pod["status"] = {
        "phase": "Failed",
        "reason": "Terminated",
        "message": "Pod was terminated in response to imminent node shutdown.",
    }
    world.settle()
    assert "avoidedNodes" not in world.status

    world = running_with_worker_2_on_node_b(World(job(failurePolicy={"avoidNodeSeconds": 0})))
    world.deleted_nodes.add("node-b")
    world.settle()
    assert "avoidedNodes" not in world.status and kept_off(world.pods["demo-worker-2"]) == []


def test_a_worker_the_taint_manager_deletes_keeps_its_successor_off_the_node() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    pod = world.pods["demo-worker-2"]
    pod["status"]["conditions"].append(
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
    )
    pod["metadata"]["deletionTimestamp"] = format_time(world.now)
    world.reconcile()
    assert [(e["node"], e["reason"]) for e in world.status["avoidedNodes"]] == [("node-b", "NodeLost")]
    world.finish_terminating()
    world.settle()
    assert kept_off(world.pods["demo-worker-2"]) == [["node-b"]]


def test_a_pressure_eviction_avoids_the_node() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    pod = world.pods["demo-worker-2"]
    pod["status"] = {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}
    world.reconcile()
    assert [(e["node"], e["reason"]) for e in world.status["avoidedNodes"]] == [("node-b", "NodePressure")]
    assert world.status["restarts"] == 0  # an eviction is not the job's failure


def test_the_store_lost_with_its_node_comes_back_elsewhere() -> None:
    world = World(job())
    world.settle()
    world.run(naming.rendezvous_name("demo"), node="node-b")
    world.run()
    world.reconcile()
    world.lose_node("node-b")
    world.reconcile()  # the store is lost: the gang restarts
    assert world.status["restartsByReason"] == {"RendezvousStoreLost": 1}
    assert [(e["node"], e["reason"]) for e in world.status["avoidedNodes"]] == [("node-b", "NodeLost")]
    world.deleted_nodes.add("node-b")
    world.finish_terminating()
    world.settle()
    assert kept_off(world.pods[naming.rendezvous_name("demo")]) == [["node-b"]]


def test_each_avoided_node_is_a_requirement_of_its_own() -> None:
    """The API server allows one value per matchFields requirement on metadata.name."""
    spec: dict[str, Any] = {}
    desired.keep_off(spec, ["node-c", "node-b"])
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [
            {
                "matchFields": [
                    {"key": "metadata.name", "operator": "NotIn", "values": ["node-b"]},
                    {"key": "metadata.name", "operator": "NotIn", "values": ["node-c"]},
                ]
            }
        ]
    }
    untouched: dict[str, Any] = {}
    desired.keep_off(untouched, [])
    assert untouched == {}


def test_the_users_own_required_node_terms_each_keep_off_the_node() -> None:
    terms = [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]},
    ]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
    world = World(job(template={"spec": {"affinity": affinity}}))
    world = running_with_worker_2_on_node_b(world)
    world.deleted_nodes.add("node-b")
    world.settle()
    worker = world.pods["demo-worker-2"]
    assert kept_off(worker) == [["node-b"], ["node-b"]]
    required = worker["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [term["matchExpressions"] for term in required["nodeSelectorTerms"]] == [
        t["matchExpressions"] for t in terms
    ]


NODE_8_GPUS = {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8", "pods": "110"}


def test_a_job_the_avoidance_leaves_without_room_says_so_until_the_time_is_up() -> None:
    world = World(job(gpus={"count": 8}, workers={"min": 2, "max": 2, "desired": 2}))
    world.node_allocatable = {"node-a": NODE_8_GPUS, "node-b": NODE_8_GPUS, "node-c": NODE_8_GPUS}
    world.settle()
    world.run("demo-worker-1", node="node-b")
    world.run()
    world.reconcile()
    world.node_allocatable = {"node-a": NODE_8_GPUS, "node-b": NODE_8_GPUS}  # node-c leaves the pool
    world.lose_node("node-b")
    world.reconcile()  # too few survivors: the gang restarts, node-b avoided
    world.deleted_nodes.add("node-b")
    world.finish_terminating()
    world.settle()
    world.unschedulable("demo-worker-0", "0/2 nodes are available: 1 node(s) didn't match Pod's node affinity.")
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "NodesAvoided")
    assert "keeps off 1 node(s) after failures" in world.status["message"]
    assert "node-b (NodeLost)" in world.status["message"]
    assert "the other 1 schedulable node(s) can hold 1 of the 2 worker(s) it needs" in world.status["message"]
    assert conditions(world)["Stalled"] == "True"
    world.now = START + timedelta(hours=2)
    world.reconcile()
    assert world.status["reason"] == "Unschedulable" and conditions(world)["Stalled"] == "False"


def test_a_waiting_job_with_room_elsewhere_names_the_nodes_it_keeps_off() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.deleted_nodes.add("node-b")
    world.settle()
    world.unschedulable("demo-worker-2", "0/2 nodes are available: 1 Insufficient cpu.")
    world.reconcile()
    assert world.status["phase"] == "Rescaling"
    assert "keeps off 1 node(s) after failures" in world.status["message"]
    assert conditions(world)["Stalled"] == "False"
