"""Scenario tests of the planner: whole lifecycles driven through the in-memory world."""

from __future__ import annotations

from phalanx.reconcile import naming
from phalanx.reconcile.observed import NodeLoss, QueuedWorkload
from phalanx.reconcile.restarts import backoff_seconds
from phalanx.reconcile.stages.job_objects import NODE_CAPACITY_STAMP_SECONDS
from phalanx.reconcile.status import format_time
from tests.unit.jobs import job, manifest
from tests.unit.simulation import World


def conditions(world: World) -> dict[str, str]:
    return {c["type"]: c["status"] for c in world.status["conditions"]}


def test_first_pass_creates_service_and_store_the_next_the_workers_and_writes_status() -> None:
    world = World(job())
    plan = world.reconcile()
    kinds = [(obj["kind"], obj["metadata"]["name"]) for obj in plan.apply]
    assert kinds == [("Service", "demo-rdzv"), ("Pod", "demo-rdzv")]  # no worker before its store exists
    workers = world.reconcile()
    assert [obj["metadata"]["name"] for obj in workers.apply] == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert world.status["phase"] == "Pending"
    assert world.status["observedGeneration"] == 1
    assert conditions(world) == {
        "Ready": "False",
        "Reconciling": "True",
        "Stalled": "False",
        "Running": "False",
        "Succeeded": "False",
        "Failed": "False",
        "Suspended": "False",
    }
    assert world.status["selector"] == "phalanx.dev/job-name=demo,phalanx.dev/role=worker"


def test_a_pass_against_its_own_result_changes_nothing() -> None:
    world = World(job())
    world.reconcile()
    world.reconcile()
    again = world.reconcile()
    assert not again.changes_children
    assert again.events == ()


def test_running_when_min_workers_and_store_ready() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"
    assert world.status["workerSummary"] == "3/3"
    assert world.status["startTime"] == "2026-11-30T12:00:00Z"
    assert conditions(world)["Ready"] == "True"
    assert conditions(world)["Reconciling"] == "False"


def test_starting_until_min_workers_are_ready() -> None:
    world = World(job())
    world.settle()
    world.schedule_only("demo-worker-0")
    world.reconcile()
    assert world.status["phase"] == "Starting"
    world.run("demo-rdzv")
    world.run("demo-worker-0")
    world.run("demo-worker-1")
    world.reconcile()
    assert world.status["phase"] == "Rescaling"  # training with 2, converging to 3
    assert world.status["workers"] == {"desired": 3, "active": 3, "ready": 2}


def test_unschedulable_pods_explain_pending() -> None:
    world = World(job())
    world.settle()
    world.unschedulable("demo-worker-0", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    world.reconcile()
    assert world.status["phase"] == "Pending"
    assert world.status["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in world.status["message"]


def test_scale_up_adds_pods_without_touching_running_ones() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    before = {name: pod["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION] for name, pod in world.pods.items()}
    world.body["spec"]["workers"]["desired"] = 4
    world.body["metadata"]["generation"] = 2
    plan = world.reconcile()
    assert [obj["metadata"]["name"] for obj in plan.apply] == ["demo-worker-3"]
    assert plan.delete == ()
    assert all(
        world.pods[name]["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION] == digest
        for name, digest in before.items()
    )
    assert world.status["observedGeneration"] == 2


def test_scale_down_deletes_highest_indices() -> None:
    world = World(job(workers={"desired": 4}))
    world.settle()
    world.run()
    world.reconcile()
    world.body["spec"]["workers"]["desired"] = 2
    plan = world.reconcile()
    assert sorted(d.name for d in plan.delete) == ["demo-worker-2", "demo-worker-3"]
    assert world.status["restarts"] == 0


def test_spec_change_that_needs_no_pod_change_makes_none() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.body["spec"]["failurePolicy"]["maxRestarts"] = 9
    world.body["spec"]["ttlSecondsAfterFinished"] = 60
    world.body["metadata"]["generation"] = 2
    plan = world.reconcile()
    assert not plan.changes_children
    assert world.status["observedGeneration"] == 2


def test_success_of_any_worker_finishes_the_job_and_stops_the_rest_after_a_grace() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.terminate("demo-worker-1", 0, "Completed")
    plan = world.reconcile()
    assert any(event.reason == "Succeeded" for event in plan.events)
    assert world.status["phase"] == "Succeeded"
    assert world.status["completionTime"] == "2026-11-30T12:00:00Z"
    assert conditions(world)["Ready"] == "True"
    assert conditions(world)["Succeeded"] == "True"
    assert plan.delete == ()  # the others are finishing too, and may need the store to shut down
    assert plan.requeue_after == 60
    world.terminate("demo-worker-0", 0, "Completed")
    world.advance(60)
    plan = world.reconcile()
    assert sorted(d.name for d in plan.delete) == ["demo-rdzv", "demo-worker-2"]


def test_ttl_deletes_the_finished_job_after_its_time() -> None:
    world = World(job(ttlSecondsAfterFinished=100))
    world.settle()
    world.run()
    world.reconcile()
    for name in ("demo-worker-0", "demo-worker-1", "demo-worker-2"):
        world.terminate(name, 0)
    world.reconcile()
    plan = world.reconcile()
    assert plan.requeue_after == 100
    world.advance(100)
    assert world.reconcile().delete_job


def test_worker_failure_with_enough_survivors_replaces_only_that_worker() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.terminate("demo-worker-1", 1, "Error", '{"message": "ValueError: bad batch"}')
    plan = world.reconcile()
    assert [d.name for d in plan.delete] == ["demo-worker-1"]
    assert world.status["restarts"] == 1
    assert world.status["restartsByReason"] == {"WorkerFailed": 1}
    assert world.status["attempt"] == 0
    assert any("ValueError: bad batch" in event.message for event in plan.events)
    plan = world.reconcile()
    assert [obj["metadata"]["name"] for obj in plan.apply] == ["demo-worker-1"]
    assert world.pods["demo-worker-1"]["metadata"]["labels"][naming.ATTEMPT_LABEL] == "0"


def test_too_few_survivors_restart_the_whole_gang_with_a_new_rendezvous() -> None:
    world = World(job(failurePolicy={"backoffSeconds": 10}))
    world.settle()
    world.run()
    world.reconcile()
    world.terminate("demo-worker-0", 1)
    world.terminate("demo-worker-1", 137, "OOMKilled")
    plan = world.reconcile()
    assert world.status["attempt"] == 1
    assert world.status["restarts"] == 1
    assert world.status["phase"] == "Restarting"
    assert sorted(d.name for d in plan.delete) == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    world.finish_terminating()
    plan = world.reconcile()
    assert plan.apply == ()  # backoff
    assert plan.requeue_after == 10
    world.advance(10)
    plan = world.reconcile()
    names = [obj["metadata"]["name"] for obj in plan.apply]
    assert names == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    env = {e["name"]: e.get("value") for e in plan.apply[0]["spec"]["containers"][0]["env"]}
    assert env["PET_RDZV_ID"].endswith("-1")
    assert env["PHALANX_ATTEMPT"] == "1"


def test_restart_budget_exhausted_fails_the_job() -> None:
    world = World(
        job(workers={"min": 3, "max": 3, "desired": 3}, failurePolicy={"maxRestarts": 1, "backoffSeconds": 0})
    )
    for expected_restarts in (1, 2):
        world.settle()
        world.run()
        world.reconcile()
        world.terminate("demo-worker-0", 1)
        world.reconcile()
        world.finish_terminating()
        assert world.status["restarts"] == expected_restarts
    assert world.status["phase"] == "Failed"
    assert world.status["reason"] == "RestartBudgetExhausted"
    assert conditions(world)["Stalled"] == "True"


def test_eviction_replaces_without_counting() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.disrupt("demo-worker-2", "PreemptionByScheduler")
    world.reconcile()
    assert world.status["restarts"] == 0
    assert world.status["restartsByReason"] == {"Preempted": 1}


def test_image_pull_error_fails_fast_with_the_reason() -> None:
    world = World(job())
    world.settle()
    world.waiting("demo-worker-0", "ImagePullBackOff", 'Back-off pulling image "example/train:1"')
    plan = world.reconcile()
    assert world.status["phase"] == "Failed"
    assert world.status["reason"] == "ImagePullFailed"
    assert "Back-off pulling image" in world.status["message"]
    assert world.status["restarts"] == 0
    assert {d.name for d in plan.delete} >= {"demo-worker-1", "demo-worker-2", "demo-rdzv"}


def test_lost_store_restarts_the_gang_without_counting() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.delete_pod("demo-rdzv")
    world.reconcile()
    assert world.status["attempt"] == 1
    assert world.status["restarts"] == 0
    assert world.status["restartsByReason"] == {"RendezvousStoreLost": 1}


def running_with_worker_2_on_node_b(world: World) -> World:
    world.settle()
    world.run("demo-worker-2", node="node-b")
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"
    return world


def test_a_ready_blip_changes_nothing() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    grace = world.node_loss.grace_seconds
    world.node_not_ready("node-b")
    plan = world.reconcile()
    assert (plan.delete, plan.apply) == ((), ())
    assert plan.requeue_after == grace  # looked at again when the grace runs out
    world.advance(8)
    assert world.reconcile().requeue_after == grace - 8
    world.node_ready("node-b")
    plan = world.reconcile()
    assert not plan.changes_children
    assert (world.status["phase"], world.status["attempt"], world.status["restartsByReason"]) == ("Running", 0, {})


def test_a_node_not_ready_past_the_grace_loses_its_pods_without_a_force_delete() -> None:
    """The container may still run on a node that stopped answering: the pod is deleted gracefully
    and its slot waits until the node comes back (the kubelet stops it) or is deleted."""
    world = running_with_worker_2_on_node_b(World(job()))
    world.lose_node("node-b")
    plan = world.reconcile()
    assert [(d.name, d.grace_seconds) for d in plan.delete] == [("demo-worker-2", None)]
    assert (world.status["restarts"], world.status["restartsByReason"]) == (0, {"NodeLost": 1})
    assert "demo-worker-2 is on node node-b, which has not been ready for 300s" in plan.events[0].message
    world.finish_terminating()  # no kubelet confirms it
    plan = world.reconcile()
    assert (plan.apply, plan.delete) == ((), ())  # neither forced nor taken over: two agents for one slot
    assert world.status["restartsByReason"] == {"NodeLost": 1}
    world.deleted_nodes.add("node-b")  # the node object is gone: no container can run there any more
    plan = world.reconcile()
    assert [(d.name, d.grace_seconds) for d in plan.delete] == [("demo-worker-2", 0)]
    world.settle()
    world.run()
    world.settle()
    assert (world.status["phase"], world.status["attempt"], world.status["restartsByReason"]) == (
        "Running",
        0,
        {"NodeLost": 1},
    )


def test_a_gang_restart_waits_for_the_pods_of_a_lost_node_and_says_so() -> None:
    world = running_with_worker_2_on_node_b(World(job(workers={"min": 3, "desired": 3})))
    world.lose_node("node-b")
    world.reconcile()  # too few survivors: the gang restarts
    world.finish_terminating()
    plan = world.reconcile()
    assert (world.status["attempt"], world.status["phase"]) == (1, "Restarting")
    assert not [obj for obj in plan.apply if obj["kind"] == "Pod" and obj["metadata"]["name"] != "demo-rdzv"]
    assert "demo-worker-2 is on node node-b, which has not been ready for" in world.status["message"]
    world.deleted_nodes.add("node-b")
    assert [(d.name, d.grace_seconds) for d in world.reconcile().delete] == [("demo-worker-2", 0)]


def test_a_deleted_nodes_pods_are_force_deleted_at_once() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.deleted_nodes.add("node-b")
    plan = world.reconcile()
    assert [(d.name, d.grace_seconds) for d in plan.delete] == [("demo-worker-2", 0)]
    assert "which was deleted" in plan.events[0].message


def test_the_operator_may_be_told_to_force_delete_the_pods_of_a_lost_node() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.node_loss = NodeLoss(grace_seconds=30, force_delete=True)
    world.node_not_ready("node-b")
    assert world.reconcile().delete == ()
    world.advance(30)
    plan = world.reconcile()
    assert [(d.name, d.grace_seconds) for d in plan.delete] == [("demo-worker-2", 0)]


def test_a_pod_the_taint_manager_evicts_is_replaced_within_the_grace() -> None:
    world = running_with_worker_2_on_node_b(World(job()))
    world.node_not_ready("node-b")
    world.disrupt("demo-worker-2", "DeletionByTaintManager")
    plan = world.reconcile()
    assert [(d.name, d.grace_seconds) for d in plan.delete] == [("demo-worker-2", 0)]  # it has finished
    assert world.status["restartsByReason"] == {"NodeLost": 1}


def test_suspend_stops_pods_and_resume_starts_a_new_attempt() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.body["spec"]["suspend"] = True
    plan = world.reconcile()
    assert len(plan.delete) == 4
    assert world.status["phase"] == "Suspended"
    assert conditions(world)["Suspended"] == "True"
    world.finish_terminating()
    world.body["spec"]["suspend"] = False
    plan = world.reconcile()
    assert world.status["attempt"] == 1
    assert world.status["restarts"] == 0
    assert [o["metadata"]["name"] for o in plan.apply if o["kind"] == "Pod"] == ["demo-rdzv"]
    assert len([o for o in world.reconcile().apply if o["kind"] == "Pod"]) == 3  # once the store exists


def test_a_resumed_job_gets_its_whole_active_deadline_again() -> None:
    """batch/v1 resets startTime when a suspended job resumes: time suspended never counts."""
    world = World(job(activeDeadlineSeconds=60))
    world.settle()
    world.run()
    world.reconcile()
    world.advance(50)
    world.body["spec"]["suspend"] = True
    world.settle()
    world.advance(3600)
    world.body["spec"]["suspend"] = False
    world.settle()
    assert world.status["phase"] == "Pending" and "startTime" not in world.status
    world.run()
    world.reconcile()
    assert (world.status["phase"], world.status["startTime"]) == ("Running", format_time(world.now))
    assert world.reconcile().requeue_after == 60
    world.advance(59)
    world.reconcile()
    assert world.status["phase"] == "Running"
    world.advance(1)
    world.reconcile()
    assert world.status["reason"] == "DeadlineExceeded"


def test_a_gang_kueue_evicted_gets_its_whole_active_deadline_again() -> None:
    """An eviction by Kueue takes the quota back and queues the gang again: a suspension in
    batch/v1 terms, so the deadline counts from when the re-admitted gang trains."""
    world = World(job(activeDeadlineSeconds=60, gang={"scheduler": "kueue", "queue": "team-a"}))
    world.workload = QueuedWorkload(name="demo-a0", admitted=True)
    world.settle()
    world.run()
    world.reconcile()
    world.advance(50)
    world.workload = QueuedWorkload(name="demo-a0", admitted=False, evicted="Preempted")
    for pod in world.workers():  # Kueue deletes an evicted group's pods
        pod["metadata"]["deletionTimestamp"] = format_time(world.now)
    world.reconcile()
    assert (world.status["attempt"], world.status["restartsByReason"]) == (1, {"Evicted": 1})
    assert "startTime" not in world.status
    world.finish_terminating()
    world.advance(3600)  # queued
    world.workload = QueuedWorkload(name="demo-a1", admitted=True)
    world.settle()
    world.run()
    world.settle()
    assert (world.status["phase"], world.status["startTime"]) == ("Running", format_time(world.now))


def test_a_restart_for_a_failure_keeps_the_deadline_running() -> None:
    world = World(job(activeDeadlineSeconds=60, workers={"min": 3, "desired": 3}))
    world.settle()
    world.run()
    world.reconcile()
    started = world.status["startTime"]
    world.advance(30)
    world.terminate("demo-worker-0", 1)
    world.reconcile()
    assert (world.status["attempt"], world.status["startTime"]) == (1, started)


def test_deadline_fails_the_job() -> None:
    world = World(job(activeDeadlineSeconds=60))
    world.settle()
    world.run()
    world.reconcile()
    assert world.reconcile().requeue_after == 60
    world.advance(61)
    world.reconcile()
    assert world.status["reason"] == "DeadlineExceeded"


def test_spec_that_cannot_be_planned_fails_with_the_field_named() -> None:
    spec = {"checkpoint": {"volumeName": "missing"}}
    world = World(job(**spec))
    plan = world.reconcile()
    assert plan.apply == ()
    assert world.status["phase"] == "Failed"
    assert world.status["reason"] == "InvalidSpec"
    assert world.status["message"].startswith("spec.checkpoint.volumeName:")


def test_backoff_grows_and_is_capped() -> None:
    policy = job(failurePolicy={"backoffSeconds": 10, "maxBackoffSeconds": 35}).spec.failure_policy
    assert [backoff_seconds(policy, n) for n in range(5)] == [0, 10, 20, 35, 35]


def test_podgroup_comes_before_pods() -> None:
    world = World(job(gpus={"count": 2}, gang={"scheduler": "scheduler-plugins"}))
    plan = world.plan()
    assert [obj["kind"] for obj in plan.apply] == ["PodGroup", "Service", "Pod"]
    world.carry_out(plan)
    plan = world.reconcile()
    assert [obj["metadata"]["name"] for obj in plan.apply] == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]


def stamp(world: World) -> str:
    group = world.objects[("PodGroup.scheduling.x-k8s.io", naming.pod_group_name("demo"))]
    return str(group["metadata"]["annotations"].get(naming.NODE_CAPACITY_ANNOTATION, ""))


def waiting_coscheduling_gang() -> World:
    world = World(job(gpus={"count": 2}, gang={"scheduler": "scheduler-plugins"}))
    world.node_capacity = "nodes-1"
    world.settle()
    assert stamp(world) == ""
    for pod in world.workers():
        world.unschedulable(pod["metadata"]["name"], "0/1 nodes are available: not enough nvidia.com/gpu")
    world.settle()  # the gang waits: the PodGroup carries the nodes it was rejected on
    return world


def test_a_waiting_coscheduling_gang_has_its_podgroup_touched_when_nodes_offer_more() -> None:
    world = waiting_coscheduling_gang()
    assert stamp(world) == f"nodes-1@{format_time(world.now)}"
    assert world.reconcile().apply == ()
    world.advance(NODE_CAPACITY_STAMP_SECONDS)
    world.node_capacity = "nodes-2"  # a node came
    applied = world.reconcile().apply
    assert [obj["kind"] for obj in applied] == ["PodGroup"]  # an update: Coscheduling tries the gang again
    assert applied[0]["metadata"]["annotations"][naming.NODE_CAPACITY_ANNOTATION].startswith("nodes-2@")
    assert applied[0]["spec"] == world.objects[("PodGroup.scheduling.x-k8s.io", naming.pod_group_name("demo"))]["spec"]
    world.run()
    world.advance(NODE_CAPACITY_STAMP_SECONDS)
    world.node_capacity = "nodes-3"  # once placed, node changes cost the PodGroup no writes
    assert [obj["kind"] for obj in world.settle().apply] == []
    assert stamp(world).startswith("nodes-2@")


def test_a_waiting_podgroup_is_stamped_at_most_once_per_interval_however_often_pods_leave() -> None:
    world = waiting_coscheduling_gang()
    writes = 0
    for second in range(1, 61):  # a pod leaves the cluster every second: a new fingerprint each time
        world.advance(1)
        world.node_capacity = f"nodes-released-{second}"
        plan = world.reconcile()
        writes += sum(1 for obj in plan.apply if obj["kind"] == "PodGroup")
        if not plan.apply:
            assert plan.requeue_after is not None  # the newest capacity is stamped when the interval ends
    assert writes == 60 / NODE_CAPACITY_STAMP_SECONDS
    assert stamp(world).startswith("nodes-released-60@")


def test_a_gang_kueue_holds_says_so_in_kueues_words() -> None:
    world = World(job(gang={"scheduler": "kueue", "queue": "team-a"}))
    world.settle()
    assert world.status["reason"] == "WorkersPending"  # no Workload yet
    world.workload = QueuedWorkload(
        name=naming.kueue_group_name("demo", 0),
        admitted=False,
        message="couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu",
    )
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "Queued")
    assert "LocalQueue team-a" in world.status["message"]
    assert "insufficient unused quota for nvidia.com/gpu" in world.status["message"]
    world.workload = QueuedWorkload(name=naming.kueue_group_name("demo", 0), admitted=True)
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"


def test_a_kueue_gang_is_never_refilled_and_a_new_size_is_a_new_group() -> None:
    world = World(job(gang={"scheduler": "kueue", "queue": "team-a"}, workers={"min": 2, "max": 3, "desired": 3}))
    world.settle()
    world.run()
    world.reconcile()
    pods = world.workers()
    assert {p["metadata"]["annotations"][naming.KUEUE_RETRIABLE_ANNOTATION] for p in pods} == {"false"}
    world.terminate("demo-worker-2", 1)
    world.settle()  # two survivors would do (min 2), but the group cannot take a replacement
    assert (world.status["attempt"], world.status["restarts"]) == (1, 1)
    world.advance(60)  # the backoff of a counted failure
    world.settle()
    groups = {p["metadata"]["labels"][naming.KUEUE_POD_GROUP_LABEL] for p in world.workers()}
    assert groups == {naming.kueue_group_name("demo", 1)}
    world.run()
    world.reconcile()
    world.body["spec"]["workers"]["desired"] = 2
    world.settle()
    assert (world.status["attempt"], world.status["restarts"], world.status["reason"]) == (2, 1, "WorkersPending")
    sizes = {p["metadata"]["annotations"][naming.KUEUE_TOTAL_COUNT_ANNOTATION] for p in world.workers()}
    assert sizes == {"2"} and len(world.workers()) == 2


def test_deleting_children_never_resets_the_budget() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.terminate("demo-worker-0", 1)
    world.reconcile()
    assert world.status["restarts"] == 1
    for name in list(world.pods):
        world.delete_pod(name)
    world.reconcile()
    assert world.status["restarts"] == 1


def test_workers_deleted_from_outside_below_min_restart_the_gang_without_counting() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    for name in ("demo-worker-0", "demo-worker-1"):
        world.pods[name]["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"  # kubectl delete
    world.reconcile()
    assert world.status["attempt"] == 1
    assert world.status["restarts"] == 0
    assert world.status["restartsByReason"] == {"WorkersDeleted": 1}
    assert world.status["phase"] == "Restarting"


def test_one_worker_deleted_from_outside_is_refilled_in_the_same_attempt() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.pods["demo-worker-2"]["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"
    plan = world.reconcile()
    assert plan.apply == ()
    assert world.status["attempt"] == 0
    world.finish_terminating()
    plan = world.reconcile()
    assert [obj["metadata"]["name"] for obj in plan.apply] == ["demo-worker-2"]
    assert world.status["restarts"] == 0


def test_a_suspended_job_is_ready_as_its_spec_asks() -> None:
    world = World(job(suspend=True))
    world.settle()
    assert world.status["phase"] == "Suspended"
    assert {k: v for k, v in conditions(world).items() if v == "True"} == {"Ready": "True", "Suspended": "True"}


NODE_8_GPUS = {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8", "pods": "110"}


def test_a_worker_larger_than_every_node_stalls_the_job_until_such_a_node_comes() -> None:
    world = World(job(gpus={"count": 16}))
    world.node_allocatable = (NODE_8_GPUS, NODE_8_GPUS)
    world.settle()
    world.unschedulable("demo-worker-0", "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "InsufficientCapacity")
    assert "no schedulable node can hold a worker" in world.status["message"]
    assert "nvidia.com/gpu 16" in world.status["message"]
    assert conditions(world)["Stalled"] == "True" and conditions(world)["Reconciling"] == "False"
    world.node_allocatable = (NODE_8_GPUS, {**NODE_8_GPUS, "nvidia.com/gpu": "48"})  # room for all 3
    world.reconcile()
    assert world.status["reason"] == "Unschedulable"  # possible again: waiting, not stalled
    assert conditions(world)["Stalled"] == "False" and conditions(world)["Reconciling"] == "True"


def test_more_workers_than_the_nodes_can_hold_stall_a_rescale_but_busy_nodes_do_not() -> None:
    world = World(job(gpus={"count": 4}, workers={"min": 2, "max": 8, "desired": 2}))
    world.node_allocatable = (NODE_8_GPUS,)
    world.settle()
    world.run()
    world.reconcile()
    world.body["spec"]["workers"]["desired"] = 3
    world.settle()
    world.unschedulable("demo-worker-2", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Rescaling", "InsufficientCapacity")
    assert "can hold at most 2 worker(s)" in world.status["message"], world.status["message"]
    assert conditions(world)["Stalled"] == "True"
    world.node_allocatable = (NODE_8_GPUS, NODE_8_GPUS)  # room for 4: the third waits for busy nodes
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Rescaling", "Rescaling")
    assert conditions(world)["Stalled"] == "False" and conditions(world)["Reconciling"] == "True"


def test_a_gang_beyond_its_queues_whole_quota_is_stalled() -> None:
    world = World(job(gang={"scheduler": "kueue", "queue": "team-a"}))
    world.settle()
    world.workload = QueuedWorkload(
        name=naming.kueue_group_name("demo", 0),
        admitted=False,
        message="couldn't assign flavors to pod set workers: insufficient quota for nvidia.com/gpu in flavor "
        "default, previously considered podsets requests (0) + current podset request (24) > maximum capacity (16)",
    )
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Pending", "ExceedsQueueCapacity")
    assert "maximum capacity (16)" in world.status["message"]
    assert conditions(world)["Stalled"] == "True"


def test_a_ttl_on_a_job_synced_from_git_is_warned_about_once() -> None:
    body = manifest(ttlSecondsAfterFinished=60)
    body["metadata"]["annotations"] = {"argocd.argoproj.io/tracking-id": "ml:phalanx.dev/TrainingJob:research/demo"}
    world = World(job(body))
    first = world.reconcile()
    warnings = [e for e in first.events if e.reason == "TTLUnderGitOps"]
    assert len(warnings) == 1 and "Argo CD will create it again" in warnings[0].message, first.events
    assert all(e.reason != "TTLUnderGitOps" for e in world.settle().events)
    assert all(e.reason != "TTLUnderGitOps" for e in World(job(ttlSecondsAfterFinished=60)).reconcile().events)
