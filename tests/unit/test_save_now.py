"""Save now (``reconcile.save_now``): the job's ``phalanx.dev/save-now`` token taken once into
``status.saveNow``, carried onto the running workers by a guarded patch of one annotation, answered
by the first checkpoint committed after the request; the notices file the workers read it from."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from phalanx.api.v1alpha1 import TrainingJob
from phalanx.cluster.cache import KEPT_METADATA_VALUE, JobCache
from phalanx.reconcile import desired, naming, pod_patches
from phalanx.reconcile.environment import resolve_launch
from phalanx.reconcile.observed import WorkerProgress, pod_record
from phalanx.reconcile.plan import progress_only
from phalanx.reconcile.save_now import requested_token
from phalanx.reconcile.status import format_time
from tests.unit import json_patch
from tests.unit.jobs import job
from tests.unit.simulation import World

CHECKPOINT = {"volumeName": "ckpt"}
VOLUMES = {"volumes": [{"name": "ckpt", "emptyDir": {}}]}
SAVE_NOW = "/metadata/annotations/phalanx.dev~1save-now"


def checkpointing_job(**spec: Any) -> Any:
    template = {"spec": {**VOLUMES, "containers": [{"name": "trainer", "image": "t:1", "command": ["torchrun"]}]}}
    return job(checkpoint=CHECKPOINT, template=template, **spec)


def running_world(**spec: Any) -> World:
    world = World(checkpointing_job(**spec))
    world.settle()
    world.run()
    world.settle()
    assert world.status["phase"] == "Running"
    return world


def request(world: World, token: str | None) -> None:
    annotations = world.body["metadata"].setdefault("annotations", {})
    if token is None:
        annotations.pop(naming.SAVE_NOW_ANNOTATION, None)
    else:
        annotations[naming.SAVE_NOW_ANNOTATION] = token


def carried(world: World) -> list[str | None]:
    return [(pod["metadata"].get("annotations") or {}).get(naming.SAVE_NOW_ANNOTATION) for pod in world.workers()]


def checkpoint(world: World, step: int, seconds_ago: float = 0) -> None:
    """A worker reports a committed checkpoint (what the progress poller writes into lastCheckpoint)."""
    world.status["lastCheckpoint"] = {"step": step, "time": format_time(world.now - timedelta(seconds=seconds_ago))}


def test_a_token_is_taken_once_and_carried_onto_every_running_worker() -> None:
    world = running_world()
    checkpoint(world, 40, seconds_ago=30)
    request(world, "2026-12-01T10:00:00Z")
    taken = world.reconcile()
    assert world.status["saveNow"] == {
        "token": "2026-12-01T10:00:00Z",
        "requestedAt": format_time(world.now),
        "afterStep": 40,
    }
    assert not progress_only({**world.status, "saveNow": None}, taken.status)  # written at once, never paced
    assert len(taken.notices) == 3 and carried(world) == ["2026-12-01T10:00:00Z"] * 3
    world.advance(5)
    again = world.reconcile()  # the same token again: nothing to take, nothing to carry
    assert "saveNow" not in again.status and again.notices == ()
    assert world.status["saveNow"]["requestedAt"] == format_time(world.now - timedelta(seconds=5))


def test_only_a_checkpoint_committed_after_the_request_and_past_its_step_answers_it() -> None:
    world = running_world()
    checkpoint(world, 40, seconds_ago=30)
    request(world, "t1")
    world.reconcile()
    world.advance(1)
    checkpoint(world, 50, seconds_ago=2)  # a periodic save from before the request, reported late
    world.reconcile()
    assert "savedToken" not in world.status["saveNow"]
    world.advance(3)
    checkpoint(world, 53)
    answered = world.reconcile()
    assert world.status["saveNow"]["savedToken"] == "t1"
    assert (world.status["saveNow"]["savedAt"], world.status["saveNow"]["step"]) == (format_time(world.now), 53)
    assert answered.notices == ()
    # a new worker (a replacement) is not given an answered token
    world.pods["demo-worker-2"]["metadata"]["annotations"].pop(naming.SAVE_NOW_ANNOTATION)
    assert world.reconcile().notices == ()


def test_a_save_in_the_requests_own_second_is_answered_by_the_token_its_workers_name() -> None:
    """The kubelet can rewrite the notices file at once and the workers save within the second:
    committed "after" the request cannot be told in whole seconds (nor across two clocks), so the
    workers' word (``phalanx_worker_last_checkpoint_save_now``) answers it; another key does not."""
    world = running_world()
    checkpoint(world, 40, seconds_ago=30)
    request(world, "t1")
    world.reconcile()
    saved = world.now + timedelta(milliseconds=600)  # the same second as the request
    world.progress = WorkerProgress(attempt=0, checkpoint_step=41, checkpoint_time=saved, checkpoint_save_now=7)
    world.reconcile()  # a key that is not t1's: the same second does not answer it
    assert "savedToken" not in world.status["saveNow"]
    world.progress = replace(world.progress, checkpoint_save_now=naming.save_now_key("t1"))
    world.reconcile()
    assert (world.status["saveNow"]["savedToken"], world.status["saveNow"]["step"]) == ("t1", 41)


def test_a_new_token_is_taken_while_the_last_answer_stays_until_its_own() -> None:
    world = running_world()
    request(world, "t1")
    world.reconcile()
    world.advance(2)
    checkpoint(world, 10)
    world.reconcile()
    world.advance(2)
    request(world, "t2")
    world.reconcile()
    status = world.status["saveNow"]
    assert (status["token"], status["savedToken"], status["step"], status["afterStep"]) == ("t2", "t1", 10, 10)
    assert carried(world) == ["t2"] * 3
    request(world, None)  # the annotation removed: the request stands, nothing is carried any more
    world.pods["demo-worker-0"]["metadata"]["annotations"][naming.SAVE_NOW_ANNOTATION] = "t1"
    assert world.reconcile().notices == ()


def test_only_running_workers_of_the_current_attempt_get_the_token() -> None:
    world = World(checkpointing_job())
    world.settle()
    world.run("demo-worker-0")
    world.reconcile()
    request(world, "t1")
    world.reconcile()
    assert world.status["saveNow"]["token"] == "t1"
    assert carried(world) == [None, None, None]  # the job is not training yet: nothing to save
    world.run()
    world.settle()
    assert world.status["phase"] == "Running" and carried(world) == ["t1"] * 3


def test_a_value_that_is_no_token_is_ignored_with_a_message_naming_the_annotation() -> None:
    world = running_world()
    request(world, "x" * 300)
    result = world.reconcile()
    message = world.status["saveNow"]["message"]
    assert message.startswith("metadata.annotations['phalanx.dev/save-now'] 'xxx") and "at most 63" in message
    assert len(message) < 300 and result.notices == () and "token" not in world.status["saveNow"]
    request(world, "ok-1")
    world.reconcile()
    assert world.status["saveNow"]["token"] == "ok-1" and "message" not in world.status["saveNow"]


def test_a_job_without_a_checkpoint_store_is_told_it_has_nowhere_to_save() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.settle()
    request(world, "t1")
    result = world.reconcile()
    assert "no spec.checkpoint" in world.status["saveNow"]["message"] and result.notices == ()


def test_the_patch_tests_the_pod_and_its_attempt_and_writes_one_annotation() -> None:
    patch = pod_patches.save_now("demo-worker-0", "uid-1", 2, "t1")
    assert patch.body() == [
        {"op": "test", "path": "/metadata/uid", "value": "uid-1"},
        {"op": "test", "path": "/metadata/labels/phalanx.dev~1attempt", "value": "2"},
        {"op": "add", "path": SAVE_NOW, "value": "t1"},
    ]
    pod = {"metadata": {"uid": "uid-1", "labels": {naming.ATTEMPT_LABEL: "2"}, "annotations": {SAVE_NOW[22:]: "t0"}}}
    once = json_patch.apply(pod, patch.body())
    assert json_patch.apply(once, patch.body()) == once  # repeat-safe
    assert once["metadata"]["annotations"][naming.SAVE_NOW_ANNOTATION] == "t1"
    assert pod_record({**once, "metadata": {**once["metadata"], "name": "p"}}).save_now == "t1"


def test_a_tenant_written_pod_value_that_is_no_token_reads_as_absent() -> None:
    pod = {"metadata": {"name": "p", "annotations": {naming.SAVE_NOW_ANNOTATION: "bad token"}}}
    record = pod_record(pod)
    assert record.save_now is None and record.ignored == (naming.SAVE_NOW_ANNOTATION,)


def test_only_a_job_with_a_checkpoint_store_mounts_the_notices_file() -> None:
    with_store = checkpointing_job()
    pod = desired.worker_pod(with_store, resolve_launch(with_store.spec), index=0, attempt=0)
    assert desired.pods.notices_volume() in pod["spec"]["volumes"]
    container = pod["spec"]["containers"][0]
    assert {"name": naming.NOTICES_VOLUME, "mountPath": naming.NOTICES_DIR, "readOnly": True} in container[
        "volumeMounts"
    ]
    assert {"name": "PHALANX_SAVE_NOW_FILE", "value": "/etc/phalanx/notices/save-now"} in container["env"]
    item = desired.pods.notices_volume()["downwardAPI"]["items"][0]
    assert item["fieldRef"]["fieldPath"] == "metadata.annotations['phalanx.dev/save-now']"

    plain = job()
    pod = desired.worker_pod(plain, resolve_launch(plain.spec), index=0, attempt=0)
    names = [volume["name"] for volume in pod["spec"].get("volumes", [])]
    assert naming.NOTICES_VOLUME not in names
    assert all(var["name"] != "PHALANX_SAVE_NOW_FILE" for var in pod["spec"]["containers"][0]["env"])


def test_the_job_cache_keeps_the_token_and_only_the_head_of_a_huge_value() -> None:
    cache = JobCache()
    body = checkpointing_job().model_dump(by_alias=True, exclude_none=True)
    body["metadata"]["annotations"] = {naming.SAVE_NOW_ANNOTATION: "t1", "team.example/notes": "x" * 5000}
    key = cache.update(body)
    assert (cache.get(key) or {})["metadata"]["annotations"] == {naming.SAVE_NOW_ANNOTATION: "t1"}

    body["metadata"]["annotations"] = {naming.SAVE_NOW_ANNOTATION: "y" * 200_000}
    body["metadata"]["resourceVersion"] = "2"
    cache.update(body)
    kept = (cache.get(key) or {})["metadata"]["annotations"][naming.SAVE_NOW_ANNOTATION]
    assert kept == "y" * KEPT_METADATA_VALUE
    token, message = requested_token(TrainingJob.from_body(cache.get(key) or {}))
    assert token is None and message is not None and "'yyy" in message and len(message) < 300
