"""Training progress: what workers serve, how the operator reads it, what the status shows."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import generate_latest

from phalanx.cluster.cache import ChildCache, JobCache
from phalanx.cluster.progress import ProgressError, ProgressPoller, parse_completion, parse_progress, reporting_worker
from phalanx.reconcile.observed import Completion, PodRecord, WorkerProgress
from phalanx.reconcile.plan import status_changed
from phalanx.worker.metrics import WorkerMetrics
from phalanx.worker.protocol import save_now_key
from tests.cluster.ports import free_port
from tests.unit.jobs import job
from tests.unit.simulation import START, World
from tests.unit.text_page import TextPage


def served(world_size: int, checkpoint: int | None) -> WorkerMetrics:
    metrics = WorkerMetrics()
    metrics.world_size.set(world_size)
    if checkpoint is not None:
        metrics.checkpoint_committed(checkpoint)
    return metrics


# -- reading a worker's metrics --------------------------------------------------------------


def test_world_size_and_the_last_checkpoint_are_read_from_a_workers_metrics() -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    progress = parse_progress(generate_latest(served(6, 120).registry).decode(), attempt=2)
    assert (progress.attempt, progress.world_size, progress.checkpoint_step) == (2, 6, 120)
    assert progress.checkpoint_time is not None and progress.checkpoint_time >= before
    assert progress.checkpoint_save_now is None  # a periodic save answers no token


def test_the_save_now_token_a_checkpoint_answered_is_read_exactly() -> None:
    metrics = WorkerMetrics()
    metrics.checkpoint_committed(130, save_now_key("2026-12-07T03:00:23Z"))
    progress = parse_progress(generate_latest(metrics.registry).decode(), attempt=0)
    assert (progress.checkpoint_step, progress.checkpoint_save_now) == (130, save_now_key("2026-12-07T03:00:23Z"))
    garbage = "phalanx_worker_last_checkpoint_step 5\nphalanx_worker_last_checkpoint_timestamp_seconds 1800000000\n"
    for value in ("-1", "NaN", "1e300", "0"):
        text = garbage + f"phalanx_worker_last_checkpoint_save_now {value}\n"
        read = parse_progress(text, attempt=0)
        assert (read.checkpoint_step, read.checkpoint_save_now) == (5, None), value


GARBAGE = [
    "phalanx_worker_world_size +Inf\nphalanx_worker_last_checkpoint_timestamp_seconds 1e300\n",
    "phalanx_worker_world_size NaN\nphalanx_worker_last_checkpoint_step -5\n"
    "phalanx_worker_last_checkpoint_timestamp_seconds 1700000000\n",
    "phalanx_worker_world_size 1e300\nphalanx_worker_last_checkpoint_step 1e300\n"
    "phalanx_worker_last_checkpoint_timestamp_seconds -Inf\n",
]


def test_values_no_worker_could_mean_are_dropped_instead_of_raising() -> None:
    for text in GARBAGE:
        assert parse_progress(text, attempt=1) == WorkerProgress(attempt=1), text


def test_a_page_that_is_not_prometheus_text_is_an_error_of_its_own_kind() -> None:
    with pytest.raises(ProgressError):
        parse_progress("phalanx_worker_world_size {{{ not metrics", attempt=0)


def test_completion_is_read_from_the_stores_page() -> None:
    text = (
        "phalanx_training_completed_attempt 2\nphalanx_training_completed_step 200\nphalanx_training_completed_rank 0\n"
    )
    assert parse_completion(text) == Completion(attempt=2, step=200, rank=0)
    assert parse_completion("\n") is None
    assert parse_completion("phalanx_training_completed_attempt +Inf\n") is None


def test_no_checkpoint_yet_reports_none_rather_than_step_zero() -> None:
    progress = parse_progress(generate_latest(served(2, None).registry).decode(), attempt=0)
    assert progress == WorkerProgress(attempt=0, world_size=2, steps=0)


def test_the_lowest_ready_worker_of_the_current_attempt_reports() -> None:
    def worker(index: int, attempt: int = 1, ready: bool = True, ip: str | None = "10.0.0.1") -> PodRecord:
        phase = "Running" if ready else "Pending"
        return PodRecord(f"w-{index}", "worker", index, attempt, phase=phase, ready=ready, pod_ip=ip)

    pods = (worker(0, attempt=0), worker(1, ready=False), worker(2, ip=None), worker(3), worker(4))
    chosen = reporting_worker(pods, attempt=1)
    assert chosen is not None and chosen.name == "w-3"
    assert reporting_worker((worker(0, attempt=0),), attempt=1) is None


def running_job_and_worker(jobs: JobCache, children: ChildCache, *, ip: str, port: int) -> None:
    jobs.update(
        {"metadata": {"namespace": "ml", "name": "demo", "uid": "uid-demo", "resourceVersion": "1"},
         "status": {"phase": "Running", "attempt": 1}}
    )  # fmt: skip
    pod: dict[str, Any] = {
        "kind": "Pod",
        "metadata": {
            "namespace": "ml",
            "name": "demo-worker-0",
            "resourceVersion": "2",
            "uid": "uid-worker-0",
            "ownerReferences": [
                {
                    "apiVersion": "phalanx.dev/v1alpha1",
                    "kind": "TrainingJob",
                    "name": "demo",
                    "uid": "uid-demo",
                    "controller": True,
                }
            ],
            "labels": {
                "phalanx.dev/job-name": "demo",
                "phalanx.dev/role": "worker",
                "phalanx.dev/worker-index": "0",
                "phalanx.dev/attempt": "1",
            },
        },
        "spec": {
            "nodeName": "node-a",
            "containers": [{"name": "trainer", "ports": [{"name": "phalanx-metrics", "containerPort": port}]}],
        },
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    children.observe("ADDED", pod)


def test_the_poller_scrapes_a_serving_worker_and_wakes_its_job_only_on_change() -> None:
    port = free_port()
    metrics = served(3, 40)
    metrics.serve(port)
    jobs, children = JobCache(), ChildCache()
    woken: list[tuple[str, str]] = []
    running_job_and_worker(jobs, children, ip="127.0.0.1", port=port)
    poller = ProgressPoller(jobs, children, woken.append, interval=60)

    async def twice() -> None:
        async with poller:
            await poller.poll_once()
            await poller.poll_once()
            metrics.checkpoint_committed(50)
            await poller.poll_once()

    asyncio.run(twice())
    assert woken == [("ml", "demo"), ("ml", "demo")]
    progress = poller.get(("ml", "demo"))
    assert progress is not None and (progress.attempt, progress.world_size, progress.checkpoint_step) == (1, 3, 50)
    poller.forget(("ml", "demo"))
    assert poller.get(("ml", "demo")) is None


def test_a_worker_that_does_not_answer_costs_only_its_fields() -> None:
    jobs, children = JobCache(), ChildCache()
    woken: list[tuple[str, str]] = []
    running_job_and_worker(jobs, children, ip="127.0.0.1", port=free_port())
    poller = ProgressPoller(jobs, children, woken.append, interval=60, timeout=0.5)

    async def once() -> None:
        async with poller:
            await poller.poll_once()

    asyncio.run(once())
    assert woken == [] and poller.get(("ml", "demo")) is None


def test_one_pod_serving_garbage_costs_only_its_own_job_and_the_poller_goes_on() -> None:
    bad_page = TextPage(GARBAGE[0])
    good_port, bad_port = free_port(), bad_page.port
    served(4, 10).serve(good_port)
    jobs, children = JobCache(), ChildCache()
    woken: list[tuple[str, str]] = []
    running_job_and_worker(jobs, children, ip="127.0.0.1", port=good_port)
    bad_job = {"metadata": {"namespace": "ml", "name": "bad", "uid": "uid-bad", "resourceVersion": "1"},
               "status": {"phase": "Running", "attempt": 0}}  # fmt: skip
    jobs.update(bad_job)
    children.observe(
        "ADDED",
        {
            "kind": "Pod",
            "metadata": {
                "namespace": "ml", "name": "bad-worker-0", "uid": "uid-bad-0", "resourceVersion": "3",
                "labels": {"phalanx.dev/job-name": "bad", "phalanx.dev/role": "worker",
                           "phalanx.dev/worker-index": "0", "phalanx.dev/attempt": "0"},
                "ownerReferences": [{"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob", "name": "bad",
                                     "uid": "uid-bad", "controller": True}],
            },
            "spec": {"containers": [{"name": "trainer",
                                     "ports": [{"name": "phalanx-metrics", "containerPort": bad_port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        },
    )  # fmt: skip
    poller = ProgressPoller(jobs, children, woken.append, interval=0.05)

    async def a_few_rounds() -> None:
        task = asyncio.create_task(poller.run())
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with bad_page:
        asyncio.run(a_few_rounds())
    assert woken.count(("ml", "demo")) == 1  # the good job's progress arrived once, unchanged since
    good = poller.get(("ml", "demo"))
    assert good is not None and good.world_size == 4
    bad = poller.get(("ml", "bad"))
    assert bad is not None and bad.scraped_at is not None  # it answered, with absurd values that are simply absent
    assert replace(bad, scraped_at=None, fresh_until=None) == WorkerProgress(attempt=0, reporter="uid-bad-0")


# -- what the status shows ---------------------------------------------------------------------


def running_world() -> World:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"
    return world


def test_status_shows_the_reported_world_size_while_the_attempt_trains() -> None:
    world = running_world()
    world.progress = WorkerProgress(attempt=0, world_size=3)
    world.reconcile()
    assert world.status["workers"]["worldSize"] == 3
    assert "lastCheckpoint" not in world.status
    assert not status_changed(world.job.status, world.plan().status)  # no PATCH while nothing changes


def test_a_report_from_an_earlier_attempt_is_not_the_world_size() -> None:
    world = running_world()
    world.progress = WorkerProgress(attempt=0, world_size=3)
    world.reconcile()
    world.progress = WorkerProgress(attempt=-1, world_size=5)
    world.reconcile()
    assert "worldSize" not in world.status["workers"]


def test_the_world_size_goes_when_the_job_stops_training() -> None:
    world = running_world()
    world.progress = WorkerProgress(attempt=0, world_size=3)
    world.reconcile()
    for name in list(world.pods):
        if "worker" in name:
            world.terminate(name, 0, reason="Completed")
    world.settle()
    assert world.status["phase"] == "Succeeded"
    assert "worldSize" not in world.status["workers"]


def test_the_last_checkpoint_is_kept_and_only_a_newer_one_replaces_it() -> None:
    world = running_world()
    saved = START + timedelta(minutes=5)
    world.progress = WorkerProgress(attempt=0, world_size=3, checkpoint_step=100, checkpoint_time=saved)
    world.reconcile()
    assert world.status["lastCheckpoint"] == {"step": 100, "time": "2026-11-30T12:05:00Z"}
    world.progress = WorkerProgress(attempt=0, world_size=3)  # a restarted worker has not saved yet
    world.reconcile()
    assert world.status["lastCheckpoint"]["step"] == 100
    older = START + timedelta(minutes=1)
    world.progress = WorkerProgress(attempt=0, world_size=3, checkpoint_step=20, checkpoint_time=older)
    world.reconcile()
    assert world.status["lastCheckpoint"]["step"] == 100
    world.progress = WorkerProgress(attempt=1, checkpoint_step=150, checkpoint_time=saved + timedelta(minutes=5))
    world.reconcile()
    assert world.status["lastCheckpoint"] == {"step": 150, "time": "2026-11-30T12:10:00Z"}
    assert not status_changed(world.job.status, world.plan().status)


def test_a_run_is_told_by_the_step_it_resumed_at_when_it_began_and_the_step_it_reached() -> None:
    metrics = served(4, 120)
    before = datetime.now(UTC).replace(microsecond=0)
    metrics.run_began(120)
    for step in range(121, 128):
        metrics.step_done(64, step)
    progress = parse_progress(generate_latest(metrics.registry).decode(), attempt=1)
    assert (progress.step, progress.resumed_step) == (127, 120)
    assert progress.run_started is not None and progress.run_started >= before
    inconsistent = (
        "phalanx_worker_step 5\nphalanx_worker_resumed_step 9\nphalanx_worker_run_start_timestamp_seconds 1700000000\n"
    )
    assert parse_progress(inconsistent, attempt=0) == WorkerProgress(attempt=0)  # resumed past its own step
