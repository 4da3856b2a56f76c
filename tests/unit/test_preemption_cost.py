"""``status.preemptionCost`` and the Kueue priority boost that follows it
(``reconcile.preemption_cost``): the cost's parts, its pacing, the boost's levels and hold, the
Workload patch and what the API server does with it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from aiohttp import web

from phalanx.api import v1alpha1 as api
from phalanx.cluster.apply import Execution, StaleStatusError, execute
from phalanx.cluster.cache import ChildCache, JobCache
from phalanx.cluster.client import ApiClient
from phalanx.cluster.events import EventRecorder
from phalanx.cluster.login import Credentials
from phalanx.cluster.refusals import RefusalMemory
from phalanx.cluster.status_pacing import StatusPacer
from phalanx.reconcile import naming
from phalanx.reconcile.observed import (
    BOOST_ANNOTATION,
    QueuedWorkload,
    ReportedProgress,
    WorkerProgress,
    queued_workload,
)
from phalanx.reconcile.plan import Plan, progress_only
from phalanx.reconcile.preemption_cost import (
    BOOST_HOLD_SECONDS,
    BOOST_LEVELS,
    WRITE_SECONDS,
    boost_for,
    boost_patch,
    preemption_cost,
)
from phalanx.reconcile.status import format_time
from phalanx.reconcile.training_progress import sample_time
from tests.unit import json_patch
from tests.unit.jobs import job
from tests.unit.local_server import serving
from tests.unit.simulation import START, World
from tests.unit.test_slot_claims import JobStore

KUEUE = {"scheduler": "kueue", "queue": "team-a"}


def running_world(**spec: Any) -> World:
    world = World(job(**spec))
    world.settle()
    world.run()
    world.settle()
    assert world.status["phase"] == "Running"
    return world


def test_boost_levels_rise_with_the_cost_and_stay_small() -> None:
    assert [boost_for(cost) for cost in (0, 59, 60, 599, 600, 3_599, 3_600, 36_000, 10**9)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        4,
        4,
    ]
    assert boost_for(10**12) == len(BOOST_LEVELS) <= 4  # far below the gaps between priority classes


def test_a_training_job_publishes_what_an_eviction_would_lose_since_it_began_training() -> None:
    world = kueue_world(gpus={"count": 4}, workers={"min": 2, "max": 2, "desired": 2})
    began = world.now
    world.advance(30)
    world.reconcile()
    cost = world.status["preemptionCost"]
    # no checkpoint: everything since the job began training is lost; restart: its start took no time here
    assert (cost["lostSeconds"], cost["gpus"], cost["workers"]) == (30, 8, 2), cost
    assert cost["gpuSeconds"] == (30 + cost["restartSeconds"]) * 8
    assert cost["workerSeconds"] == (30 + cost["restartSeconds"]) * 2
    assert cost["time"] == sample_time(began + timedelta(seconds=30))


def test_the_restart_time_is_measured_as_the_stretch_that_led_into_training() -> None:
    world = World(job())
    world.settle()
    for pod in world.workers():
        world.schedule_only(pod["metadata"]["name"])
    world.reconcile()
    assert world.status["timeByState"]["state"] == "starting"
    world.advance(7)
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"
    restart = world.status["preemptionCost"]["restartSeconds"]
    assert restart == 7 == world.status["timeByState"]["starting"]
    world.advance(WRITE_SECONDS)
    world.reconcile()
    assert world.status["preemptionCost"]["restartSeconds"] == restart  # kept while the job trains


def test_a_checkpoint_resets_the_lost_time_and_an_older_one_does_not() -> None:
    world = kueue_world()
    began = world.now
    world.advance(100)
    world.status["lastCheckpoint"] = {"step": 10, "time": format_time(began - timedelta(seconds=50))}
    world.reconcile()
    assert world.status["preemptionCost"]["lostSeconds"] == 100  # older than this training stretch
    world.status["lastCheckpoint"] = {"step": 20, "time": format_time(world.now - timedelta(seconds=4))}
    world.advance(WRITE_SECONDS)
    world.reconcile()
    assert world.status["preemptionCost"]["lostSeconds"] == 14


def test_a_new_checkpoint_lowers_the_cost_at_once_not_on_the_next_tick() -> None:
    """Under Kueue the job that just saved must be the cheapest candidate now: a checkpoint this pass
    records makes the cost due, computed from it, and the boost falls with it (once its minute is up)."""
    world = kueue_world(gpus={"count": 8})
    world.advance(BOOST_HOLD_SECONDS)
    world.reconcile()
    assert world.status["preemptionCost"]["boost"] == 2  # 60 s x 3 workers x 8 GPUs: 1,440 GPU-seconds
    world.workload = QueuedWorkload(name="demo-a0", admitted=True, uid="wl-1", boost_text="2", annotated=True)
    world.advance(BOOST_HOLD_SECONDS)
    world.reconcile()
    world.advance(1)  # a second after the last write: the clock would hold the cost for 9 s more
    world.progress = WorkerProgress(attempt=0, checkpoint_step=40, checkpoint_time=world.now)
    saved = world.reconcile()
    assert saved.status["lastCheckpoint"]["step"] == 40
    assert saved.status["preemptionCost"]["lostSeconds"] == 0
    assert saved.boost is not None and saved.boost.boost == 0


def test_the_cost_is_written_at_most_once_per_ten_seconds_as_progress() -> None:
    world = kueue_world()
    world.advance(30)
    world.reconcile()
    first = dict(world.status["preemptionCost"])
    world.advance(WRITE_SECONDS - 1)
    held = world.reconcile()
    assert "preemptionCost" not in held.status and world.status["preemptionCost"] == first
    world.advance(1)
    due = world.reconcile()
    assert due.status["preemptionCost"]["lostSeconds"] == first["lostSeconds"] + WRITE_SECONDS
    before = {**world.status, "preemptionCost": first}
    assert progress_only(before, due.status)  # paced like the other progress fields


def test_a_reporting_job_writes_its_cost_with_its_progress_on_one_clock() -> None:
    world = running_world()
    world.advance(30)
    world.reconcile()
    before = world.version
    for second in range(40):  # rank 0 reports every second, the operator passes every second
        world.advance(1)
        world.reported = ReportedProgress(
            job_uid=world.job.metadata.uid, attempt=0, step=second, total_steps=None, time=world.now
        )
        world.reconcile()
    assert world.version - before <= 5  # as progress alone: one write per 10 s, not two
    progress_time = world.status["progress"]["samples"][-1]["time"]
    assert world.status["preemptionCost"]["time"] == progress_time  # the cost rode the progress write


def test_outside_kueue_a_job_that_reports_nothing_is_never_written_for_its_cost_alone() -> None:
    """No scheduler acts on such a job's cost: refreshing it alone every 10 s would be a status
    write per job per 10 s for nothing. A write made for another reason carries the fresh value."""
    world = running_world()
    began = world.now
    assert world.status["preemptionCost"]["lostSeconds"] == 0  # written on entering training
    before = world.version
    for _ in range(6):
        world.advance(WRITE_SECONDS)
        assert "preemptionCost" not in world.reconcile().status
    assert world.version == before
    world.body["spec"]["workers"]["desired"] = 4  # a rescale: status is written anyway
    rescaled = world.reconcile()
    assert rescaled.status["preemptionCost"]["lostSeconds"] == 60
    assert world.status["preemptionCost"]["time"] == sample_time(began + timedelta(seconds=60))


def test_a_job_that_stops_training_drops_its_cost() -> None:
    world = running_world()
    world.advance(30)
    world.reconcile()
    assert "preemptionCost" in world.status
    world.body["spec"]["suspend"] = True
    world.settle()
    assert world.status["phase"] == "Suspended" and "preemptionCost" not in world.status


def test_a_pass_against_its_own_result_changes_nothing_with_a_cost() -> None:
    world = running_world()
    world.advance(30)
    world.reconcile()
    again = world.plan()
    assert "preemptionCost" not in again.status and again.boost is None


def workload(boost: str | None = None, *, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    notes = dict(annotations or {})
    if boost is not None:
        notes[BOOST_ANNOTATION] = boost
    metadata: dict[str, Any] = {"name": naming.kueue_group_name("demo", 0), "uid": "wl-1"}
    if notes:
        metadata["annotations"] = notes
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": metadata}


def test_kueues_workload_says_its_uid_and_boost_and_a_bad_boost_reads_as_zero() -> None:
    assert queued_workload(workload("3")).boost == 3 and queued_workload(workload("3")).uid == "wl-1"
    assert queued_workload(workload()).boost_text is None and not queued_workload(workload()).annotated
    assert queued_workload(workload("-2")).boost == -2
    assert queued_workload(workload("lots")).boost == 0
    huge = queued_workload(workload("9" * 300_000))  # bounded: never kept whole
    assert huge.boost_text == "" and huge.boost == 0


@pytest.mark.parametrize(
    ("before", "annotations"),
    [(None, None), (None, {"team": "a"}), ("1", None)],
    ids=["no-annotations", "other-annotations", "boost-there"],
)
def test_the_boost_patch_sets_the_annotation_whatever_the_workload_had(
    before: str | None, annotations: dict[str, str] | None
) -> None:
    body = workload(before, annotations=annotations)
    patch = boost_patch(queued_workload(body), 2)
    patched = json_patch.apply(body, patch.body())
    assert patched["metadata"]["annotations"][BOOST_ANNOTATION] == "2"
    assert {k: v for k, v in patched["metadata"]["annotations"].items() if k != BOOST_ANNOTATION} == (annotations or {})
    if before is None:  # repeated: the same annotation again
        assert json_patch.apply(patched, patch.body()) == patched
    else:  # repeated: its test of the old value refuses it
        with pytest.raises(json_patch.PatchFailedError):
            json_patch.apply(patched, patch.body())


def test_the_boost_patch_changes_nothing_on_another_workload_or_a_changed_value() -> None:
    body = workload("1")
    patch = boost_patch(queued_workload(body), 2)
    with pytest.raises(json_patch.PatchFailedError):
        json_patch.apply({**body, "metadata": {**body["metadata"], "uid": "wl-2"}}, patch.body())  # recreated
    with pytest.raises(json_patch.PatchFailedError):
        json_patch.apply(workload("3"), patch.body())  # someone else set it since


def kueue_world(**spec: Any) -> World:
    """A Running job under Kueue, where the cost acts (the boost) and so is refreshed on its own."""
    world = World(job(gang=KUEUE, **spec))
    world.workload = QueuedWorkload(name=naming.kueue_group_name("demo", 0), admitted=True, uid="wl-1")
    world.settle()
    world.run()
    world.settle()
    assert world.status["phase"] == "Running"
    return world


def test_under_kueue_the_boost_follows_the_cost_held_at_least_a_minute() -> None:
    world = kueue_world()
    world.advance(BOOST_LEVELS[0])
    plan = world.reconcile()
    assert plan.boost is not None and plan.boost.boost == 1 and plan.boost.name == "demo-a0"
    assert plan.requeue_after is not None and plan.requeue_after <= WRITE_SECONDS
    assert (world.status["preemptionCost"]["boost"], world.status["preemptionCost"]["boostTime"]) == (
        1,
        format_time(world.now),
    )
    world.workload = QueuedWorkload(name="demo-a0", admitted=True, uid="wl-1", boost_text="1", annotated=True)
    # the job saves: its cost falls under the first level, but the boost stands for a minute
    world.status["lastCheckpoint"] = {"step": 5, "time": format_time(world.now)}
    for _ in range(int(BOOST_HOLD_SECONDS // WRITE_SECONDS) - 1):
        world.advance(WRITE_SECONDS)
        world.status["lastCheckpoint"] = {"step": 5, "time": format_time(world.now)}
        assert world.reconcile().boost is None
    world.advance(WRITE_SECONDS)
    world.status["lastCheckpoint"] = {"step": 6, "time": format_time(world.now)}
    plan = world.reconcile()
    assert plan.boost is not None and plan.boost.boost == 0
    assert plan.boost.body()[1:] == [
        {"op": "test", "path": "/metadata/annotations/kueue.x-k8s.io~1priority-boost", "value": "1"},
        {"op": "replace", "path": "/metadata/annotations/kueue.x-k8s.io~1priority-boost", "value": "0"},
    ]


def test_a_job_not_under_kueue_sends_no_boost_and_asks_for_no_extra_pass() -> None:
    world = running_world()
    world.advance(10 * BOOST_LEVELS[-1])
    plan = world.reconcile()
    assert plan.boost is None and plan.requeue_after is None and "boost" not in world.status["preemptionCost"]


def test_a_boost_already_on_the_workload_is_recorded_without_a_patch() -> None:
    status = api.TrainingJobStatus.model_validate(
        {
            "phase": "Running",
            "conditions": [
                {"type": "Running", "status": "True", "lastTransitionTime": format_time(START), "reason": "R"}
            ],
        }
    )
    there = QueuedWorkload(name="demo-a0", admitted=True, uid="wl-1", boost_text="1", annotated=True)
    update = preemption_cost(
        status,
        "Running",
        workers=1,
        gpus_per_worker=0,
        workload=there,
        progress_written=False,
        progress_time=None,
        now=START + timedelta(seconds=100),
    )
    assert update.boost is None and update.value is not None and update.value["boost"] == 1


def test_after_a_gang_restart_the_restart_time_is_the_whole_recovery() -> None:
    world = running_world(workers={"min": 3, "desired": 3}, failurePolicy={"backoffSeconds": 10})
    world.advance(100)
    world.reconcile()
    world.terminate("demo-worker-1", 1)  # too few survivors: the gang restarts
    world.reconcile()
    assert world.status["timeByState"]["state"] == "recovering"
    world.advance(10)  # the backoff, the old pods stopping, the new ones queued and starting
    world.finish_terminating()
    world.settle()
    world.advance(4)
    world.run()
    world.settle()
    assert world.status["phase"] == "Running" and world.status["attempt"] == 1
    assert world.status["timeByState"]["recovering"] == 14
    cost = world.status["preemptionCost"]
    assert (cost["restartSeconds"], cost["lostSeconds"]) == (14, 0), cost


# -- the apply path: the boost goes after the status that records it, and never before -----------

WORKLOAD_PATH = "/apis/kueue.x-k8s.io/v1beta2/namespaces/ml/workloads/{name}"


class BoostStore(JobStore):
    """JobStore with Kueue's Workload, patched as the API server does (422 when a test fails)."""

    def __init__(self, status: dict[str, Any]) -> None:
        super().__init__(status)
        self.workload = workload("1")
        self.workload["metadata"]["namespace"] = "ml"
        self.app.router.add_patch(WORKLOAD_PATH, self.patch_workload)

    refuse = False

    async def patch_workload(self, request: web.Request) -> web.Response:
        self.requests.append(f"patch workload {request.match_info['name']}")
        if self.refuse:
            return web.json_response({"reason": "Forbidden", "message": "denied by a webhook"}, status=403)
        try:
            self.workload = json_patch.apply(self.workload, await request.json())
        except json_patch.PatchFailedError as error:
            return web.json_response({"reason": "Invalid", "message": str(error)}, status=422)
        return web.json_response(self.workload)


RUNNING = {"phase": "Running", "reason": "WorkersReady", "message": "1 worker(s) training", "attempt": 0}


@pytest.fixture
async def boost_store() -> AsyncIterator[tuple[BoostStore, Execution]]:
    backend = BoostStore(dict(RUNNING))
    async with serving(backend.app) as url, ApiClient(Credentials(server=url), timeout=2) as client:
        pacer = StatusPacer(interval=60.0)
        pacer.wrote(("ml", "demo"))  # a progress write went out a moment ago: the next would wait
        yield backend, Execution(client, JobCache(), ChildCache(), RefusalMemory(), EventRecorder(client), pacer)


def boosting_plan() -> Plan:
    boost = boost_patch(queued_workload(workload("1")), 2)
    cost = {"lostSeconds": 700, "gpus": 0, "workers": 1, "workerSeconds": 700, "boost": 2, "boostTime": "x"}
    return Plan(status={**RUNNING, "preemptionCost": cost}, boost=boost)


async def test_a_boost_is_sent_after_the_status_that_records_it_which_the_pacer_does_not_hold(
    boost_store: tuple[BoostStore, Execution],
) -> None:
    backend, run = boost_store
    await execute(boosting_plan(), run, job=backend.job(backend.version), now=START)
    assert backend.requests == ["status at 7", "patch workload demo-a0"]
    assert backend.workload["metadata"]["annotations"][BOOST_ANNOTATION] == "2"
    await execute(boosting_plan(), run, job=backend.job(backend.version), now=START)  # sent again: refused, harmless
    assert backend.workload["metadata"]["annotations"][BOOST_ANNOTATION] == "2"


async def test_a_boost_planned_from_a_stale_job_is_never_sent(boost_store: tuple[BoostStore, Execution]) -> None:
    backend, run = boost_store
    with pytest.raises(StaleStatusError):
        await execute(boosting_plan(), run, job=backend.job(backend.version - 1), now=START)
    assert backend.requests == ["status at 6"]
    assert backend.workload["metadata"]["annotations"][BOOST_ANNOTATION] == "1"


async def test_a_refused_boost_is_logged_and_the_pass_goes_on(boost_store: tuple[BoostStore, Execution]) -> None:
    backend, run = boost_store
    backend.refuse = True
    await execute(boosting_plan(), run, job=backend.job(backend.version), now=START)  # does not raise
    assert backend.requests == ["status at 7", "patch workload demo-a0"]
    assert backend.workload["metadata"]["annotations"][BOOST_ANNOTATION] == "1"
