"""Warm spares (workers.spares): pods beyond desired whose supervisor waits with its imports done; a
ready spare takes an empty slot in the same pass that finds it empty, and a new spare is created
behind it once every slot holds a scheduled worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from phalanx.reconcile import naming, pod_patches
from phalanx.reconcile.spares import SPARE_FAILED
from phalanx.reconcile.status import format_time
from tests.unit.jobs import job
from tests.unit.simulation import World

ATTEMPT = pod_patches.label(naming.ATTEMPT_LABEL)

SUPERVISED = ["phalanx-supervise", "--", "torchrun"]


def with_spares(spares: int = 1, command: list[str] | None = None, **spec: Any) -> World:
    containers = [{"name": "trainer", "image": "example/train:1", "command": command or SUPERVISED}]
    workers = {"min": 2, "max": 4, "desired": 3, "spares": spares, **spec.pop("workers", {})}
    return World(job(template={"spec": {"containers": containers}}, workers=workers, **spec))


def names(pods: list[dict[str, Any]]) -> list[str]:
    return [pod["metadata"]["name"] for pod in pods]


def training(world: World) -> World:
    world.settle()
    world.run()
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"
    return world


def slot_of(pod: dict[str, Any]) -> str | None:
    slot = pod["metadata"]["labels"].get(naming.WORKER_INDEX_LABEL)
    return str(slot) if slot is not None else None


def test_spares_are_created_once_every_slot_holds_a_scheduled_worker_and_are_not_workers() -> None:
    world = with_spares(2)
    world.settle()
    assert world.spares() == []  # the gang first: a spare must not take a worker's place
    world.run()
    world.settle()
    assert names(world.spares()) == ["demo-spare-0", "demo-spare-1"]
    spare = world.spares()[0]
    labels = spare["metadata"]["labels"]
    assert labels[naming.ROLE_LABEL] == naming.ROLE_SPARE and naming.WORKER_INDEX_LABEL not in labels
    assert spare["metadata"]["annotations"][naming.RENDEZVOUS_ID_ANNOTATION] == "5f1c0d2e-0"
    variables = {var["name"] for var in spare["spec"]["containers"][0]["env"]}
    assert "PHALANX_WORKER_INDEX" not in variables  # no slot until promoted: the supervisor reads it then
    assert {"name": naming.POD_INFO_VOLUME, "mountPath": naming.POD_INFO_DIR, "readOnly": True} in spare["spec"][
        "containers"
    ][0]["volumeMounts"]
    world.run()
    world.reconcile()
    assert world.status["workers"]["spares"] == 2 and world.status["workerSummary"] == "3/3 +2 spare"
    assert world.status["replicas"] == 3  # the scale subresource counts workers only


def test_a_failed_worker_is_replaced_by_a_ready_spare_and_the_world_re_forms_in_place_at_once() -> None:
    world = training(with_spares(1))
    before = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in world.workers()}
    spare_uid = world.spares()[0]["metadata"]["uid"]
    world.terminate("demo-worker-1", 1)
    replaced = world.reconcile()
    # a new rendezvous id, so that torchrun need not wait for the lost agent's keep-alives to run out
    assert world.status["attempt"] == 1 and world.status["restarts"] == 1  # counted once, no backoff
    assert world.status["restartsByReason"] == {"WorkerFailed": 1} and world.status.get("restartNotBefore") is None
    assert sorted((m.name, m.uid, m.promotes_slot, m.attempt) for m in replaced.move) == [
        ("demo-spare-0", spare_uid, 1, 1),
        ("demo-worker-0", before["demo-worker-0"], None, 1),
        ("demo-worker-2", before["demo-worker-2"], None, 1),
    ]
    assert [d.name for d in replaced.delete] == ["demo-worker-1"]
    assert not [obj for obj in replaced.apply if obj["kind"] == "Pod"]
    promoted = world.pods["demo-spare-0"]
    assert promoted["metadata"]["labels"][naming.ROLE_LABEL] == naming.ROLE_WORKER and slot_of(promoted) == "1"
    assert promoted["metadata"]["annotations"][naming.RENDEZVOUS_ID_ANNOTATION] == "5f1c0d2e-1"
    assert {e.reason for e in replaced.events} >= {"SparePromoted", "WorkerFailed"}
    behind = world.reconcile()  # every slot held: a new spare at once, the old pod need not be gone
    assert names([obj for obj in behind.apply if obj["kind"] == "Pod"]) == ["demo-spare-1"]
    world.finish_terminating()
    world.settle()
    assert "demo-worker-1" not in world.pods  # the slot is the spare's: no pod of that name comes back
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running" and world.status["workers"]["ready"] == 3
    assert sorted(slot_of(pod) or "" for pod in world.workers()) == ["0", "1", "2"]
    assert world.status["restarts"] == 1


def test_a_worker_being_deleted_from_outside_has_its_slot_taken_before_it_is_gone() -> None:
    world = training(with_spares(1))
    world.pods["demo-worker-2"]["metadata"]["deletionTimestamp"] = format_time(world.now)
    taken = world.reconcile()
    assert [(m.name, m.promotes_slot) for m in taken.move if m.promotes_slot is not None] == [("demo-spare-0", 2)]
    assert world.status["restarts"] == 0  # deleted from outside: not counted
    assert world.status["restartsByReason"] == {"WorkersDeleted": 1}


def test_with_fewer_ready_spares_than_lost_slots_the_rest_get_new_pods_once_their_old_ones_are_gone() -> None:
    world = training(with_spares(1, workers={"max": 4, "desired": 4}))
    world.terminate("demo-worker-1", 1)
    world.terminate("demo-worker-2", 1)
    replaced = world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restarts"] == 1  # one failure event
    assert [(m.name, m.promotes_slot) for m in replaced.move if m.promotes_slot is not None] == [("demo-spare-0", 1)]
    assert "demo-spare-0 takes slot 1; 3 worker(s) re-form the world in place" in world.status["message"]
    world.finish_terminating()
    refilled = world.reconcile()
    assert names([obj for obj in refilled.apply if obj["kind"] == "Pod"]) == ["demo-worker-2"]


def test_a_gang_restart_keeps_the_survivors_and_fills_the_lost_slot_with_a_spare_while_the_old_pod_stops() -> None:
    world = training(with_spares(1, workers={"min": 3, "desired": 3}))
    kept = {name: world.pods[name]["metadata"]["uid"] for name in ("demo-worker-0", "demo-worker-1")}
    world.pods["demo-worker-2"]["metadata"]["deletionTimestamp"] = format_time(world.now)  # kubectl delete pod
    restart = world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restarts"] == 0
    assert {(m.name, m.attempt) for m in restart.move} == {("demo-worker-0", 1), ("demo-worker-1", 1)}
    filled = world.reconcile()  # the old pod still stops: the spare has a name of its own
    assert "demo-worker-2" in world.pods
    assert [(m.name, m.promotes_slot, m.tested(ATTEMPT), m.attempt) for m in filled.move] == [
        ("demo-spare-0", 2, "0", 1)
    ]
    assert world.pods["demo-spare-0"]["metadata"]["annotations"][naming.RENDEZVOUS_ID_ANNOTATION] == "5f1c0d2e-1"
    world.finish_terminating()
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"
    assert {name: world.pods[name]["metadata"]["uid"] for name in kept} == kept
    assert names(world.spares()) == ["demo-spare-1"]


def test_a_promotion_planned_from_an_older_view_changes_nothing() -> None:
    world = training(with_spares(1))
    world.terminate("demo-worker-1", 1)
    first = world.plan()
    world.carry_out(first)
    world.carry_out(first)  # sent twice (a retry after a lost answer): the pod is no spare any more
    assert slot_of(world.pods["demo-spare-0"]) == "1"
    assert world.status["restarts"] == 1 and world.status["attempt"] == 1
    again = world.plan()
    assert not again.move and world.status["attempt"] == 1


def two_spares_on_two_nodes() -> World:
    """Three workers training on node-a; demo-spare-0 waits on node-b, demo-spare-1 on node-a."""
    world = with_spares(2)
    world.settle()
    world.run()
    world.settle()
    world.run("demo-spare-0", node="node-b")
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running" and len(world.spares()) == 2
    return world


def test_spares_on_a_lost_node_or_beyond_the_count_go_and_a_suspended_job_keeps_none() -> None:
    world = two_spares_on_two_nodes()
    world.lose_node("node-b")
    gone = world.reconcile()
    assert "demo-spare-0" in {d.name for d in gone.delete}
    world.body["spec"]["workers"]["spares"] = 0
    fewer = world.reconcile()
    assert {d.name for d in fewer.delete} >= {"demo-spare-1"}
    world.body["spec"]["workers"]["spares"] = 1
    world.settle()
    assert len([p for p in world.spares() if not p["metadata"].get("deletionTimestamp")]) == 1
    world.node_ready("node-b")  # its kubelet confirms the deletion
    world.body["spec"]["suspend"] = True
    world.settle()
    assert world.spares() == [] and world.workers() == []


def test_a_failed_spare_is_recorded_once_not_against_the_budget_and_spares_stop_after_max_restarts() -> None:
    world = training(with_spares(1, failurePolicy={"maxRestarts": 1}))
    for round_ in range(2):
        [spare] = world.spares()
        world.terminate(spare["metadata"]["name"], 137, reason="OOMKilled")
        failed = world.reconcile()
        assert [e.reason for e in failed.events if e.reason == SPARE_FAILED] == [SPARE_FAILED]
        again = world.reconcile()  # seen again before it is gone: not recorded twice
        assert SPARE_FAILED not in {e.reason for e in again.events}
        assert world.status["restartsByReason"] == {SPARE_FAILED: round_ + 1}
        assert world.status["restarts"] == 0 and world.status["phase"] == "Running"
        world.settle()
        world.run()
    world.reconcile()
    assert world.spares() == []  # two spares failed, more than maxRestarts: no third


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"command": ["torchrun"]}, "phalanx-supervise"),
        ({"gang": {"scheduler": "kueue", "queue": "q"}}, "kueue"),
        ({"launcher": "static"}, "launcher torchrun"),
    ],
)
def test_spares_without_what_they_need_are_refused_naming_the_field(spec: dict[str, Any], why: str) -> None:
    world = with_spares(1, **spec)
    world.reconcile()
    assert world.status["phase"] == "Failed" and world.status["reason"] == "InvalidSpec"
    assert world.status["message"].startswith("spec.workers.spares: ") and why in world.status["message"]


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param({"workers": {"spares": 1}}, id="spares set on a job whose command is not supervised"),
        # refused at admission since the containers' command is declared (CRDs before that let it through)
        pytest.param({"template": {"spec": {"containers": [{"name": "trainer", "image": "example/train:1",
                                                            "command": ["torchrun"]}]}}}, id="supervisor taken away"),
    ],
)  # fmt: skip
def test_an_edit_that_makes_spares_impossible_mid_run_keeps_handling_failures_and_ends_succeeded(
    edit: dict[str, Any],
) -> None:
    """A running job whose spec can no longer have spares trains on without them (Stalled says
    why): a failed worker is still replaced, and the run that completes is Succeeded."""
    world = training(with_spares(0 if "workers" in edit else 1, command=None if "template" in edit else ["torchrun"]))
    spec = world.body["spec"]
    for key, value in edit.items():
        spec[key] = {**spec[key], **value}
    world.terminate("demo-worker-1", 1)
    handled = world.reconcile()
    assert world.status["restarts"] == 1 and world.status["phase"] != "Failed"
    stalled = next(c for c in world.status["conditions"] if c["type"] == "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "InvalidSpec"
    assert "spec.workers.spares" in stalled["message"]
    assert "InvalidSpec" in {event.reason for event in handled.events}
    world.finish_terminating()
    world.settle()
    world.run()
    world.settle()
    assert world.spares() == []  # none created from a spec that cannot have them
    for pod in world.workers(world.status["attempt"]):
        world.terminate(pod["metadata"]["name"], 0)
    world.reconcile()
    assert (world.status["phase"], world.status["reason"]) == ("Succeeded", "Succeeded")


def test_spares_join_the_pod_group_but_not_its_min_member() -> None:
    world = with_spares(1, gang={"scheduler": "scheduler-plugins"})
    world.settle()
    world.run()
    world.settle()
    [spare] = world.spares()
    assert spare["metadata"]["labels"][naming.COSCHEDULING_POD_GROUP_LABEL] == "demo"
    [group] = [obj for obj in world.objects.values() if obj["kind"] == "PodGroup"]
    assert group["spec"]["minMember"] == 2


def test_a_sigkill_after_the_re_formed_attempt_was_recorded_still_moves_and_promotes_once() -> None:
    world = training(with_spares(1))
    before = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in world.workers()}
    world.terminate("demo-worker-1", 1)
    world.carry_out(world.plan(), stop_after_status=True)  # the operator dies after the status write
    assert world.status["attempt"] == 1 and world.status["restarts"] == 1
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["restarts"] == 1 and world.status["attempt"] == 1  # nothing counted twice
    assert world.status["phase"] == "Running"
    slots = {slot_of(pod): pod["metadata"]["name"] for pod in world.workers()}
    assert slots == {"0": "demo-worker-0", "1": "demo-spare-0", "2": "demo-worker-2"}
    assert {pod["metadata"]["uid"] for pod in world.workers()} >= {before["demo-worker-0"], before["demo-worker-2"]}
    assert {pod["metadata"]["labels"][naming.ATTEMPT_LABEL] for pod in world.workers()} == {"1"}


def test_a_ready_spare_takes_the_slot_of_a_worker_that_waits_for_a_node_and_that_worker_goes() -> None:
    # issue 31 point 4: the spare took the capacity the lost worker freed, and its new pod waits
    world = with_spares(1)
    world.settle()
    world.run()
    world.settle()
    world.unschedulable("demo-spare-0", "0/3 nodes are available: 3 Insufficient cpu.")
    world.reconcile()
    assert world.status["phase"] == "Running"
    world.terminate("demo-worker-1", 1)
    world.reconcile()  # no spare ready: the world re-forms without slot 1
    world.finish_terminating()
    refilled = world.reconcile()
    assert names([obj for obj in refilled.apply if obj["kind"] == "Pod"]) == ["demo-worker-1"]
    world.run("demo-spare-0", node="node-b")
    world.unschedulable("demo-worker-1", "0/3 nodes are available: 3 Insufficient cpu.")
    waiting_uid = world.pods["demo-worker-1"]["metadata"]["uid"]
    taken = world.reconcile()
    assert [(m.name, m.promotes_slot, m.attempt) for m in taken.move] == [("demo-spare-0", 1, 1)]
    assert [d.name for d in taken.delete] == ["demo-worker-1"]
    assert world.pods["demo-worker-1"]["metadata"]["uid"] == waiting_uid
    world.reconcile()  # seen stopping (bound just before the deletion): its slot is the spare's, nothing is lost
    assert world.status["attempt"] == 1 and "WorkersDeleted" not in world.status["restartsByReason"]
    world.finish_terminating()
    world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restarts"] == 1  # nothing counted for the waiting pod
    assert world.status["restartsByReason"] == {"WorkerFailed": 1}
    assert world.status["phase"] == "Running" and world.status["workers"]["ready"] == 3
    assert {slot_of(pod): pod["metadata"]["name"] for pod in world.workers()} == {
        "0": "demo-worker-0",
        "1": "demo-spare-0",
        "2": "demo-worker-2",
    }


def test_a_sigkill_between_the_promotion_and_the_deletion_of_the_waiting_pod_still_leaves_one_pod_per_slot() -> None:
    world = with_spares(1)
    world.settle()
    world.run()
    world.settle()
    world.run()
    world.reconcile()
    world.pods["demo-worker-2"]["status"] = {"phase": "Pending"}  # as if just created, waiting for a node
    world.pods["demo-worker-2"]["spec"].pop("nodeName")
    taken = world.plan()
    assert [(m.name, m.promotes_slot) for m in taken.move] == [("demo-spare-0", 2)]
    world.carry_out(replace(taken, delete=()))  # the operator dies after the promotion
    doubled = world.reconcile()
    assert [d.name for d in doubled.delete] == ["demo-worker-2"] and not doubled.move
    assert not [obj for obj in doubled.apply if obj["kind"] == "Pod"]  # no spare while the slot is doubled
    world.finish_terminating()
    world.reconcile()
    assert world.status["attempt"] == 0 and not world.status.get("restartsByReason")
    assert {slot_of(pod): pod["metadata"]["name"] for pod in world.workers()}["2"] == "demo-spare-0"


def test_no_spare_is_created_while_a_slot_is_empty_or_its_worker_waits_for_a_node() -> None:
    world = training(with_spares(0))
    world.pods["demo-worker-1"]["metadata"]["deletionTimestamp"] = format_time(world.now)  # kubectl delete pod
    world.reconcile()  # the world re-forms without slot 1, whose pod still stops
    world.body["spec"]["workers"]["spares"] = 1
    emptied = world.reconcile()
    assert not [obj for obj in emptied.apply if obj["kind"] == "Pod"]  # slot 1 is empty: the worker first
    world.finish_terminating()
    refilled = world.reconcile()
    assert names([obj for obj in refilled.apply if obj["kind"] == "Pod"]) == ["demo-worker-1"]
    world.unschedulable("demo-worker-1", "0/3 nodes are available: 3 Insufficient cpu.")
    waiting = world.reconcile()
    assert not [obj for obj in waiting.apply if obj["kind"] == "Pod"] and world.spares() == []
    world.run()
    behind = world.reconcile()
    assert names([obj for obj in behind.apply if obj["kind"] == "Pod"]) == ["demo-spare-0"]


def test_spares_rank_below_the_workers_in_the_operators_spare_priority_class() -> None:
    # issue 31 point 4: a spare waiting for a node must not take the room a worker waits for
    containers = [{"name": "trainer", "image": "example/train:1", "command": SUPERVISED}]
    template = {"spec": {"containers": containers, "preemptionPolicy": "PreemptLowerPriority"}}
    world = World(job(template=template, workers={"min": 2, "max": 4, "desired": 3, "spares": 1}))
    world.spare_priority_class = "phalanx-spare"
    world.settle()
    world.run()
    world.settle()
    [spare] = world.spares()
    assert spare["spec"]["priorityClassName"] == "phalanx-spare"
    assert "preemptionPolicy" not in spare["spec"]  # the class's (Never): the admission refuses another
    assert all("priorityClassName" not in pod["spec"] for pod in world.workers())
    assert {pod["spec"]["preemptionPolicy"] for pod in world.workers()} == {"PreemptLowerPriority"}


def test_spares_of_a_job_whose_workers_name_a_priority_class_keep_it() -> None:
    containers = [{"name": "trainer", "image": "example/train:1", "command": SUPERVISED}]
    template = {"spec": {"containers": containers, "priorityClassName": "training", "preemptionPolicy": "Never"}}
    world = World(job(template=template, workers={"min": 2, "max": 4, "desired": 3, "spares": 1}))
    world.spare_priority_class = "phalanx-spare"
    world.settle()
    world.run()
    world.settle()
    [spare] = world.spares()
    # its class's value is unknown to the operator: the workers' own is the lowest known not above theirs
    assert spare["spec"]["priorityClassName"] == "training" and spare["spec"]["preemptionPolicy"] == "Never"


def shut_down(world: World, name: str) -> None:
    """The kubelet's graceful node shutdown: the pod Failed with reason Terminated, its container
    ended by SIGTERM (a spare's supervisor exits 0)."""
    world.terminate(name, 0)
    world.pods[name]["status"].update(
        phase="Failed", reason="Terminated", message="Pod was terminated in response to imminent node shutdown."
    )


@pytest.mark.parametrize(
    "stop",
    [
        pytest.param(lambda world, name: world.disrupt(name), id="evicted"),
        pytest.param(lambda world, name: world.disrupt(name, "PreemptionByScheduler"), id="preempted"),
        pytest.param(lambda world, name: world.disrupt(name, "DeletionByTaintManager"), id="taint-manager"),
        pytest.param(shut_down, id="node-shutdown"),
        pytest.param(lambda world, name: world.terminate(name, 0), id="sigterm"),
    ],
)
def test_a_spare_stopped_by_its_node_or_the_cluster_spends_none_of_the_spares_budget(
    stop: Callable[[World, str], None],
) -> None:
    # issue 31 point 8: only a spare's own failure counts towards the spares' budget
    world = training(with_spares(1, failurePolicy={"maxRestarts": 0}))
    for _ in range(3):
        [spare] = world.spares()
        stop(world, spare["metadata"]["name"])
        stopped = world.reconcile()
        assert SPARE_FAILED not in {e.reason for e in stopped.events}
        assert SPARE_FAILED not in world.status.get("restartsByReason", {})
        world.settle()
        world.run()
        world.reconcile()
        assert len(world.spares()) == 1 and world.status["phase"] == "Running"
    assert world.status["restarts"] == 0


def test_a_spare_that_cannot_pull_its_image_is_its_own_failure() -> None:
    world = training(with_spares(1, failurePolicy={"maxRestarts": 0}))
    [spare] = world.spares()
    world.waiting(spare["metadata"]["name"], "ImagePullBackOff", "Back-off pulling image")
    failed = world.reconcile()
    assert SPARE_FAILED in {e.reason for e in failed.events}
    assert world.status["restartsByReason"] == {SPARE_FAILED: 1} and world.status["phase"] == "Running"
    world.settle()
    assert world.spares() == []  # more spares failed than maxRestarts: no new one


def test_a_spare_is_not_promoted_into_a_slot_a_scale_down_removes_in_the_same_pass() -> None:
    # issue 31 point 9: desired drops from 3 to 2 in the pass that sees worker 2 (now surplus) fail
    world = training(with_spares(1))
    world.body["spec"]["workers"]["desired"] = 2
    world.terminate("demo-worker-2", 1)
    both = world.reconcile()
    assert not [m for m in both.move if m.promotes_slot is not None]
    assert [pod["metadata"]["name"] for pod in world.spares()] == ["demo-spare-0"]
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running" and world.status["workers"]["ready"] == 2
    assert sorted(slot_of(pod) or "" for pod in world.workers()) == ["0", "1"]
    assert names(world.spares()) == ["demo-spare-0"]
