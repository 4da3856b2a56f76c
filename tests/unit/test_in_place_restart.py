"""Gang restarts in place: a job whose command runs phalanx-supervise keeps its healthy worker pods
through a gang restart, moves them to the new attempt (label and rendezvous id, which the
supervisor reads from a downward-API volume), and replaces only the pods that were lost or failed.
Counting, backoff and the budget stay as in a restart that recreates the gang."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.reconcile import naming, pod_patches
from phalanx.reconcile.environment import resolve_launch, runs_supervisor
from phalanx.reconcile.status import format_time
from tests.unit.jobs import job
from tests.unit.simulation import World

ATTEMPT = pod_patches.label(naming.ATTEMPT_LABEL)

SUPERVISED = ["phalanx-supervise", "--", "torchrun"]


def supervised_job(**spec: Any) -> World:
    containers = [{"name": "trainer", "image": "example/train:1", "command": SUPERVISED, "args": ["train.py"]}]
    return World(job(template={"spec": {"containers": containers}}, **spec))


def uids(world: World) -> dict[str, str]:
    return {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in world.workers()}


def env(pod: dict[str, Any]) -> dict[str, Any]:
    return {var["name"]: var.get("value") for var in pod["spec"]["containers"][0]["env"]}


def training(world: World) -> World:
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"
    return world


@pytest.mark.parametrize(
    ("command", "supervised"),
    [
        (["phalanx-supervise", "--", "torchrun", "-m", "train"], True),
        (["/usr/local/bin/phalanx-supervise"], True),
        (["python3", "-m", "phalanx.worker.supervise", "--", "python", "train.py"], True),
        (["python", "-u", "-m", "phalanx.worker.supervise"], True),
        (["torchrun", "-m", "train"], False),
        (["sh", "-c", "phalanx-supervise -- torchrun train.py"], False),  # a shell is not looked into
        (None, False),  # the image's entrypoint is not known
    ],
)
def test_the_supervisor_is_recognised_in_the_trainer_command(command: list[str] | None, supervised: bool) -> None:
    assert runs_supervisor(command) is supervised


def test_a_supervised_pod_reads_its_attempt_from_a_downward_api_volume() -> None:
    world = training(supervised_job())
    pod = world.workers()[0]
    variables = env(pod)
    assert "PHALANX_ATTEMPT" not in variables and "PET_RDZV_ID" not in variables  # they change in place
    assert variables["PHALANX_POD_INFO_DIR"] == naming.POD_INFO_DIR
    assert variables["PHALANX_STOP_GRACE_SECONDS"] == "30"
    assert pod["metadata"]["annotations"][naming.RENDEZVOUS_ID_ANNOTATION] == "5f1c0d2e-0"
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == naming.POD_INFO_VOLUME]
    paths = {item["path"]: item["fieldRef"]["fieldPath"] for item in volume["downwardAPI"]["items"]}
    assert paths == {
        "attempt": "metadata.labels['phalanx.dev/attempt']",
        "rendezvous-id": "metadata.annotations['phalanx.dev/rendezvous-id']",
        "role": "metadata.labels['phalanx.dev/role']",
        "worker-index": "metadata.labels['phalanx.dev/worker-index']",
        "rank-address": "metadata.annotations['phalanx.dev/rank-address']",
    }
    assert variables["PHALANX_WORKER_INDEX"] == "0"  # a worker's slot never changes; a spare's comes from the file
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert {"name": naming.POD_INFO_VOLUME, "mountPath": naming.POD_INFO_DIR, "readOnly": True} in mounts
    assert world.status["restartMode"] == "InPlace"


def test_without_the_supervisor_or_under_kueue_the_gang_is_recreated() -> None:
    plain = training(World(job()))
    assert plain.status["restartMode"] == "Recreate"
    assert env(plain.workers()[0])["PET_RDZV_ID"] == "5f1c0d2e-0"
    containers = [{"name": "trainer", "image": "example/train:1", "command": SUPERVISED}]
    queued = job(template={"spec": {"containers": containers}}, gang={"scheduler": "kueue", "queue": "q"})
    assert resolve_launch(queued.spec).restart_mode == "Recreate"  # each attempt is a pod group of its own


def test_a_lost_store_restarts_the_gang_in_place_keeping_every_worker_pod() -> None:
    world = training(supervised_job())
    before = uids(world)
    world.delete_pod("demo-rdzv")
    restart = world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restarts"] == 0
    assert not [d for d in restart.delete if d.name.startswith("demo-worker")]
    [event] = [e for e in restart.events if e.reason == "GangRestart"]
    assert "restarting the gang in place as attempt 1 (3 of 3 workers kept)" in event.message
    assert not restart.move  # not while the old store may still run: the moved launchers would dial it
    moved = world.reconcile()  # the old store gone: the new one, and the pods moved beside it
    assert [obj["metadata"]["name"] for obj in moved.apply if obj["kind"] == "Pod"] == ["demo-rdzv"]
    assert {move.name for move in moved.move} == set(before)
    assert world.status["phase"] == "Restarting" and "restarting 3 worker(s) in place" in world.status["message"]
    world.run("demo-rdzv")
    world.settle()
    assert uids(world) == before  # the same pods
    for pod in world.workers():
        assert pod["metadata"]["labels"][naming.ATTEMPT_LABEL] == "1"
        assert pod["metadata"]["annotations"][naming.RENDEZVOUS_ID_ANNOTATION] == "5f1c0d2e-1"
    world.reconcile()
    assert world.status["phase"] == "Running" and world.status["restartsByReason"] == {"RendezvousStoreLost": 1}


def test_too_few_survivors_replace_only_the_failed_pods_counted_once_after_the_backoff() -> None:
    world = training(supervised_job())
    before = uids(world)
    world.terminate("demo-worker-1", 1)
    world.terminate("demo-worker-2", 1)
    restart = world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restarts"] == 1
    assert {d.name for d in restart.delete} == {"demo-worker-1", "demo-worker-2"}
    assert "(1 of 3 workers kept)" in world.status["message"]
    assert not restart.move  # a counted failure: after the backoff
    world.finish_terminating()
    world.run("demo-rdzv")
    waiting = world.reconcile()  # backoff: the kept pod's processes are not restarted yet
    assert not waiting.move and world.status["reason"] == "Backoff"
    world.advance(10)
    moved = world.reconcile()
    assert [(m.name, m.uid, m.tested(ATTEMPT), m.attempt) for m in moved.move] == [
        ("demo-worker-0", before["demo-worker-0"], "0", 1)
    ]
    replaced = world.reconcile()
    created = sorted(obj["metadata"]["name"] for obj in replaced.apply if obj["kind"] == "Pod")
    assert created == ["demo-worker-1", "demo-worker-2"]
    world.run()
    world.settle()
    assert uids(world)["demo-worker-0"] == before["demo-worker-0"]
    assert world.status["restarts"] == 1 and world.status["restartsByReason"] == {"WorkerFailed": 1}
    assert world.status["phase"] == "Running"


def test_a_sigkill_after_the_new_attempt_was_recorded_still_moves_the_kept_pods_once() -> None:
    world = training(supervised_job())
    before = uids(world)
    world.delete_pod("demo-rdzv")
    world.carry_out(world.plan(), stop_after_status=True)  # the operator dies after the status write
    assert world.status["attempt"] == 1
    world.settle()
    world.run("demo-rdzv")
    world.settle()
    assert uids(world) == before
    assert {pod["metadata"]["labels"][naming.ATTEMPT_LABEL] for pod in world.workers()} == {"1"}
    assert world.status["restartsByReason"] == {"RendezvousStoreLost": 1}
    again = world.plan()  # a move planned again from an older view changes nothing: it tests the attempt
    assert not again.move


def test_without_a_backoff_or_an_old_store_the_kept_pods_move_in_the_restarts_own_pass() -> None:
    world = supervised_job()
    world.settle()
    world.run("demo-worker-1", node="node-b")
    world.run("demo-worker-2", node="node-b")
    world.run()
    world.reconcile()
    before = uids(world)
    world.deleted_nodes.add("node-b")  # two workers lost with their node: not counted, no backoff
    restart = world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restartsByReason"] == {"NodeLost": 1}
    assert [(m.name, m.uid, m.attempt) for m in restart.move] == [("demo-worker-0", before["demo-worker-0"], 1)]
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running" and uids(world)["demo-worker-0"] == before["demo-worker-0"]


def test_pods_on_a_node_that_is_not_ready_or_whose_container_exited_are_replaced() -> None:
    world = supervised_job()
    world.settle()
    world.run("demo-worker-2", node="node-b")
    world.run()
    world.reconcile()
    world.node_not_ready("node-b")  # a blip: not lost, but its pod is not kept through a restart
    world.terminate("demo-worker-1", 0, terminal=False)  # exited, the kubelet has not said Succeeded yet
    world.delete_pod("demo-rdzv")
    restart = world.reconcile()
    assert {d.name for d in restart.delete} == {"demo-worker-1", "demo-worker-2"}
    assert "(1 of 3 workers kept)" in world.status["message"]


def test_an_old_pod_created_without_the_supervisor_is_replaced_not_moved() -> None:
    world = training(World(job()))
    plain = uids(world)
    containers = [{"name": "trainer", "image": "example/train:1", "command": SUPERVISED, "args": ["train.py"]}]
    body = world.body
    body["spec"]["template"]["spec"]["containers"] = containers
    world.delete_pod("demo-rdzv")
    restart = world.reconcile()
    assert world.status["restartMode"] == "InPlace"
    assert {d.name for d in restart.delete} == set(plain)  # no downward-API volume: they could not follow


def test_the_rendezvous_keep_alive_sets_how_soon_a_silent_loss_is_dropped() -> None:
    default = training(World(job()))
    assert "keep_alive_interval=5,keep_alive_max_attempt=3," in env(default.workers()[0])["PET_RDZV_CONF"]
    quick = training(World(job(rendezvous={"keepAliveSeconds": 1})))
    assert "keep_alive_interval=1,keep_alive_max_attempt=3," in env(quick.workers()[0])["PET_RDZV_CONF"]


def test_a_worker_lost_while_min_survive_re_forms_the_world_in_place_at_once() -> None:
    """Under the old rendezvous id torchrun's survivors would wait out the lost agent's keep-alives;
    a new attempt's id lets them re-form at once, and the slot's new pod joins that world later."""
    world = training(supervised_job())
    before = uids(world)
    world.terminate("demo-worker-2", 1)
    reformed = world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restarts"] == 1  # counted once, as a replacement
    assert world.status.get("restartNotBefore") is None  # no backoff: nothing waits
    assert sorted((m.name, m.attempt) for m in reformed.move) == [("demo-worker-0", 1), ("demo-worker-1", 1)]
    assert [d.name for d in reformed.delete] == ["demo-worker-2"]
    assert "2 worker(s) re-form the world in place as attempt 1" in world.status["message"]
    refilled = world.reconcile()
    assert [obj["metadata"]["name"] for obj in refilled.apply if obj["kind"] == "Pod"] == ["demo-worker-2"]
    assert world.status["phase"] == "Rescaling"  # the two train on while the third starts
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"
    now = uids(world)
    assert now["demo-worker-0"] == before["demo-worker-0"] and now["demo-worker-2"] != before["demo-worker-2"]
    assert {pod["metadata"]["labels"][naming.ATTEMPT_LABEL] for pod in world.workers()} == {"1"}


def test_workers_failing_together_re_form_once_with_an_event_each() -> None:
    world = training(supervised_job(workers={"min": 1, "max": 4, "desired": 3}))
    world.terminate("demo-worker-1", 1)
    world.terminate("demo-worker-2", 137, "OOMKilled")
    reformed = world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restarts"] == 1  # one failure event
    assert sorted(e.reason for e in reformed.events if e.type == "Warning") == ["WorkerFailed", "WorkerOOMKilled"]


def test_a_surplus_pod_still_stopping_when_desired_grows_again_is_no_loss() -> None:
    """The operator deleted it (a scale-down) and recorded so before: its slot is refilled once it
    is gone, and the world does not re-form for it."""
    world = training(supervised_job(workers={"min": 2, "max": 4, "desired": 4}))
    before = uids(world)
    world.body["spec"]["workers"]["desired"] = 3
    down = world.reconcile()
    assert [d.name for d in down.delete] == ["demo-worker-3"]
    world.body["spec"]["workers"]["desired"] = 4  # back up while demo-worker-3 is still stopping
    up = world.reconcile()
    assert not up.move and not up.delete and world.status["attempt"] == 0
    assert world.status["restartsByReason"] == {}
    assert not [e for e in up.events if e.reason.startswith(("GangRestart", "Worker"))]
    world.finish_terminating()
    refilled = world.reconcile()
    assert [obj["metadata"]["name"] for obj in refilled.apply if obj["kind"] == "Pod"] == ["demo-worker-3"]
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running" and world.status["attempt"] == 0
    assert {name: uid for name, uid in uids(world).items() if name != "demo-worker-3"} == {
        name: uid for name, uid in before.items() if name != "demo-worker-3"
    }
    assert "removedWorkers" not in world.status  # pruned: the pod it named is gone


def test_a_worker_someone_else_deletes_beside_the_operators_own_re_forms_the_world() -> None:
    world = training(supervised_job(workers={"min": 2, "max": 4, "desired": 4}))
    world.body["spec"]["workers"]["desired"] = 3
    world.reconcile()
    world.body["spec"]["workers"]["desired"] = 4
    world.pods["demo-worker-1"]["metadata"]["deletionTimestamp"] = format_time(world.now)  # kubectl delete
    reformed = world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restartsByReason"] == {"WorkersDeleted": 1}
    assert sorted(m.name for m in reformed.move) == ["demo-worker-0", "demo-worker-2"]


def test_a_sigkill_between_recording_a_removal_and_the_deletion_still_tells_it_apart() -> None:
    world = training(supervised_job(workers={"min": 2, "max": 4, "desired": 4}))
    world.body["spec"]["workers"]["desired"] = 3
    world.carry_out(world.plan(), stop_after_status=True)  # recorded, then the operator dies
    assert world.status["removedWorkers"] == [uids(world)["demo-worker-3"]]
    world.reconcile()  # a new leader deletes it
    assert world.pods["demo-worker-3"]["metadata"].get("deletionTimestamp")
    world.body["spec"]["workers"]["desired"] = 4
    world.reconcile()
    assert world.status["attempt"] == 0 and world.status["restartsByReason"] == {}


def kept_through_a_backoff(world: World) -> World:
    """demo-worker-0 on node-b kept by a gang restart that waits out its backoff (the others failed)."""
    world.settle()
    world.run("demo-worker-0", node="node-b")
    world.run()
    world.reconcile()
    world.terminate("demo-worker-1", 1)
    world.terminate("demo-worker-2", 1)
    world.reconcile()
    assert world.status["attempt"] == 1 and world.status["restartNotBefore"]
    world.finish_terminating()
    return world


def test_a_ready_blip_during_the_backoff_keeps_the_kept_pods() -> None:
    world = kept_through_a_backoff(supervised_job())
    kept = uids(world)["demo-worker-0"]
    world.node_not_ready("node-b")
    world.advance(3)
    blip = world.reconcile()
    assert "demo-worker-0" not in {d.name for d in blip.delete} and world.status["reason"] == "Backoff"
    world.node_ready("node-b")
    world.advance(10)
    moved = world.reconcile()
    assert [(m.name, m.uid, m.attempt) for m in moved.move] == [("demo-worker-0", kept, 1)]


def test_a_node_lost_during_the_backoff_loses_the_kept_pods() -> None:
    world = kept_through_a_backoff(supervised_job(failurePolicy={"backoffSeconds": 600}))
    world.node_not_ready("node-b")
    world.advance(world.node_loss.grace_seconds - 1)
    assert "demo-worker-0" not in {d.name for d in world.reconcile().delete}
    world.advance(1)
    lost = world.reconcile()
    assert [(d.name, d.grace_seconds) for d in lost.delete] == [("demo-worker-0", None)]  # not forced
