"""Warm spares (workers.spares): pods beyond desired whose supervisor waits with its imports done; a
ready spare takes an empty slot in the same pass that finds it empty, and a new spare is created
behind it once every slot holds a scheduled worker."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.reconcile import naming
from phalanx.reconcile.spares import SPARE_FAILED
from phalanx.reconcile.status import format_time
from tests.unit.jobs import job
from tests.unit.simulation import World

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
    assert sorted((m.name, m.uid, m.index, m.to_attempt) for m in replaced.move) == [
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
    assert [(m.name, m.index) for m in taken.move if m.index is not None] == [("demo-spare-0", 2)]
    assert world.status["restarts"] == 0  # deleted from outside: not counted
    assert world.status["restartsByReason"] == {"WorkersDeleted": 1}


def test_with_fewer_ready_spares_than_lost_slots_the_rest_get_new_pods_once_their_old_ones_are_gone() -> None:
    world = training(with_spares(1, workers={"max": 4, "desired": 4}))
    world.terminate("demo-worker-1", 1)
    world.terminate("demo-worker-2", 1)
    replaced = world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restarts"] == 1  # one failure event
    assert [(m.name, m.index) for m in replaced.move if m.index is not None] == [("demo-spare-0", 1)]
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
    assert {(m.name, m.to_attempt) for m in restart.move} == {("demo-worker-0", 1), ("demo-worker-1", 1)}
    filled = world.reconcile()  # the old pod still stops: the spare has a name of its own
    assert "demo-worker-2" in world.pods
    assert [(m.name, m.index, m.from_attempt, m.to_attempt) for m in filled.move] == [("demo-spare-0", 2, 0, 1)]
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


def test_spares_on_a_lost_node_or_beyond_the_count_go_and_a_suspended_job_keeps_none() -> None:
    world = with_spares(2)
    world.settle()
    world.run()
    world.settle()
    world.run("demo-spare-0", node="node-b")
    world.run()
    world.reconcile()
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
