"""Hang detection: failurePolicy.progressDeadlineSeconds restarts a Running gang whose workers
stopped stepping, counted, and judges nothing it cannot see."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import REGISTRY, generate_latest

from phalanx.cluster.cache import ChildCache, JobCache
from phalanx.cluster.progress import ProgressPoller, parse_progress
from phalanx.reconcile.observed import WorkerProgress
from phalanx.worker.metrics import WorkerMetrics
from tests.cluster.ports import free_port
from tests.unit.jobs import job
from tests.unit.local_server import serving
from tests.unit.simulation import World, running
from tests.unit.test_progress import running_job_and_worker
from tests.unit.test_progress_hostile import worker_pod
from tests.unit.text_page import TextPage

DEADLINE = 300


def test_a_workers_step_counter_is_read() -> None:
    metrics = WorkerMetrics()
    for _ in range(7):
        metrics.step_done(0)
    assert parse_progress(generate_latest(metrics.registry).decode(), attempt=1).steps == 7
    assert parse_progress("phalanx_worker_world_size 2\n", attempt=1).steps is None
    assert parse_progress("phalanx_worker_steps_total NaN\n", attempt=1).steps is None


def test_the_step_clock_runs_from_when_the_count_last_changed() -> None:
    port = free_port()
    metrics = WorkerMetrics()
    metrics.serve(port)
    jobs, children = JobCache(), ChildCache()
    running_job_and_worker(jobs, children, ip="127.0.0.1", port=port)
    now = [datetime(2026, 12, 1, 8, 0, tzinfo=UTC)]
    woken: list[tuple[str, str]] = []
    poller = ProgressPoller(jobs, children, woken.append, interval=60, clock=lambda: now[0])
    key = ("ml", "demo")

    async def poll() -> WorkerProgress | None:
        async with poller:
            await poller.poll_once()
        return poller.get(key)

    first = asyncio.run(poll())
    assert first is not None and (first.steps, first.reporter, first.stepped_since) == (0, "uid-worker-0", now[0])
    started = now[0]
    now[0] += timedelta(minutes=3)
    unchanged = asyncio.run(poll())
    assert unchanged is not None and unchanged.stepped_since == started  # the same count: the clock runs on
    assert woken == [key]  # and nobody is woken for it
    metrics.step_done(0)
    now[0] += timedelta(minutes=1)
    stepped = asyncio.run(poll())
    assert stepped is not None and stepped.steps == 1 and stepped.stepped_since == now[0]
    assert woken == [key, key]
    metrics.close()


def hang_job(deadline: int | None = DEADLINE, **policy: object) -> World:
    failure_policy: dict[str, object] = {"backoffSeconds": 0, **policy}
    if deadline is not None:
        failure_policy["progressDeadlineSeconds"] = deadline
    return running(World(job(failurePolicy=failure_policy)))


FRESH = timedelta(seconds=45)  # three 15 s poll intervals


def reporting(world: World, steps: int, since: datetime) -> None:
    worker = world.workers(attempt=world.status["attempt"])[0]
    world.progress = WorkerProgress(
        attempt=world.status["attempt"],
        steps=steps,
        reporter=worker["metadata"]["uid"],
        stepped_since=since,
        scraped_at=world.now,
        fresh_until=world.now + FRESH,
    )


def answered(world: World) -> None:
    """The reporter answered a scrape just now, its count unchanged."""
    assert world.progress is not None
    world.progress = replace(world.progress, scraped_at=world.now, fresh_until=world.now + FRESH, unanswered=0)


def test_a_gang_that_stops_stepping_restarts_counted_with_reason_no_progress() -> None:
    world = hang_job()
    reporting(world, 40, world.now)
    world.advance(DEADLINE - 1)
    waiting = world.reconcile()
    assert world.status["phase"] == "Running" and waiting.requeue_after == 1  # it comes back at the deadline
    world.advance(1)
    answered(world)
    restart = world.reconcile()
    assert world.status["phase"] == "Restarting" and world.status["reason"] == "NoProgress"
    assert world.status["restarts"] == 1 and world.status["restartsByReason"] == {"NoProgress": 1}
    assert world.status["attempt"] == 1
    [event] = [e for e in restart.events if e.reason == "NoProgress"]
    assert event.type == "Warning" and f"no training step for {DEADLINE}s" in event.message
    assert "demo-worker-0's step count stayed at 40" in event.message and "attempt 1" in event.message
    conditions = {c["type"]: c for c in world.status["conditions"]}
    assert conditions["Reconciling"]["status"] == "True" and conditions["Reconciling"]["reason"] == "NoProgress"
    assert {deletion.name for deletion in restart.delete} >= {"demo-worker-0", "demo-worker-1", "demo-worker-2"}
    world.finish_terminating()
    world.settle()
    assert [w["metadata"]["labels"]["phalanx.dev/attempt"] for w in world.workers()] == ["1", "1", "1"]
    again = world.reconcile()  # the old attempt's report is no verdict on the new one
    assert world.status["restarts"] == 1 and not again.delete


def test_steps_that_advance_keep_the_job_running() -> None:
    world = hang_job()
    for steps in range(5):
        reporting(world, steps, world.now)
        world.advance(DEADLINE - 10)
        world.reconcile()
    assert world.status["phase"] == "Running" and world.status["restarts"] == 0


def test_the_clock_starts_no_earlier_than_the_job_became_running_again() -> None:
    world = hang_job()
    reporting(world, 40, world.now - timedelta(hours=1))  # a count last seen to change long ago
    world.reconcile()
    assert world.status["phase"] == "Running"  # the job became Ready just now: the whole deadline is its own
    world.advance(DEADLINE)
    answered(world)
    world.reconcile()
    assert world.status["reason"] == "NoProgress"


def test_nothing_is_judged_without_a_step_count_off_by_default_or_while_not_running() -> None:
    unmeasured = hang_job()
    unmeasured.progress = WorkerProgress(attempt=0, world_size=3)  # the script serves no step counter
    unmeasured.advance(DEADLINE * 10)
    unmeasured.reconcile()
    assert unmeasured.status["phase"] == "Running"

    off = hang_job(deadline=None)
    reporting(off, 40, off.now)
    off.advance(86400)
    off.reconcile()
    assert off.status["phase"] == "Running"

    rescaling = hang_job()
    reporting(rescaling, 40, rescaling.now)
    rescaling.body["spec"]["workers"]["desired"] = 4
    rescaling.reconcile()
    assert rescaling.status["phase"] == "Rescaling"
    rescaling.advance(DEADLINE * 2)
    rescaling.reconcile()  # the world is re-forming: steps pause by design
    assert rescaling.status["phase"] == "Rescaling" and rescaling.status["restarts"] == 0


def test_a_hang_past_the_budget_fails_the_job() -> None:
    world = hang_job(maxRestarts=0)
    reporting(world, 3, world.now)
    world.advance(DEADLINE)
    answered(world)
    world.reconcile()
    assert world.status["phase"] == "Failed" and world.status["reason"] == "RestartBudgetExhausted"
    assert "no training step" in world.status["message"]


def test_a_verdict_is_written_once_however_often_the_pass_repeats() -> None:
    world = hang_job()
    reporting(world, 40, world.now)
    world.advance(DEADLINE)
    answered(world)
    first = world.plan()
    world.carry_out(first, stop_after_status=True)  # SIGKILL right after the status write
    stale = replace(world.progress, attempt=0) if world.progress else None
    world.progress = stale
    world.reconcile()
    world.reconcile()
    assert world.status["restarts"] == 1 and world.status["attempt"] == 1


# -- stale samples: a reporter that stopped answering is no hang -------------------------------


def conditions(world: World) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in world.status["conditions"]}


def test_a_reporter_that_stops_answering_is_reported_not_counted() -> None:
    world = hang_job()
    reporting(world, 40, world.now)
    world.advance(DEADLINE)  # no answer since: the count of 40 is all the operator knows
    world.progress = replace(world.progress, unanswered=20) if world.progress else None
    silent = world.reconcile()
    assert world.status["phase"] == "Running" and world.status["restarts"] == 0, world.status
    assert "restartsByReason" not in world.status or not world.status["restartsByReason"]
    assert not silent.delete
    assert conditions(world)["Stalled"] == ("True", "ProgressUnknown")
    [event] = [e for e in silent.events if e.reason == "ProgressUnknown"]
    assert event.type == "Warning" and "demo-worker-0 last answered a progress scrape at" in event.message
    assert "20 unanswered since" in event.message
    again = world.reconcile()  # said once, not at every pass
    assert not [e for e in again.events if e.reason == "ProgressUnknown"] and world.status["restarts"] == 0

    world.progress = replace(world.progress, steps=41, stepped_since=world.now) if world.progress else None
    answered(world)  # it answers again, and it did train meanwhile
    world.reconcile()
    assert conditions(world)["Stalled"][0] == "False" and world.status["restarts"] == 0


def test_a_fresh_answer_after_a_silence_is_judged() -> None:
    world = hang_job()
    reporting(world, 40, world.now)
    world.advance(DEADLINE * 2)
    world.reconcile()
    assert world.status["phase"] == "Running" and conditions(world)["Stalled"] == ("True", "ProgressUnknown")
    answered(world)  # back, and still at 40: a real hang
    world.reconcile()
    assert world.status["reason"] == "NoProgress" and world.status["restarts"] == 1


def test_a_sample_without_a_scrape_time_is_no_verdict() -> None:
    world = hang_job()
    worker = world.workers(attempt=0)[0]
    world.progress = WorkerProgress(attempt=0, steps=40, reporter=worker["metadata"]["uid"], stepped_since=world.now)
    world.advance(DEADLINE * 3)
    world.reconcile()
    assert world.status["phase"] == "Running" and world.status["restarts"] == 0


def scrape_failures(target: str = "worker") -> float:
    value = REGISTRY.get_sample_value(
        "phalanx_job_progress_scrape_failures_total", {"namespace": "ml", "name": "demo", "target": target}
    )
    return value or 0.0


def test_the_poller_keeps_a_silent_reporters_last_answer_with_its_time_and_counts_the_silence() -> None:
    page = TextPage("phalanx_worker_steps_total 40\n")
    jobs, children = JobCache(), ChildCache()
    running_job_and_worker(jobs, children, ip="127.0.0.1", port=page.port)
    now = [datetime(2026, 12, 1, 8, 0, tzinfo=UTC)]
    woken: list[tuple[str, str]] = []
    poller = ProgressPoller(jobs, children, woken.append, interval=15, timeout=0.5, clock=lambda: now[0])
    key = ("ml", "demo")

    async def poll() -> WorkerProgress | None:
        async with poller:
            await poller.poll_once()
        return poller.get(key)

    with page:
        first = asyncio.run(poll())
        assert first is not None and first.steps == 40 and first.scraped_at == now[0] and first.unanswered == 0
        assert first.fresh_until is not None and first.fresh_until > now[0] + timedelta(seconds=15)
        answered_at, failures = now[0], scrape_failures()
        page.status = 503  # the worker trains on, but its scrapes go unanswered
        for _ in range(4):
            now[0] += timedelta(seconds=15)
            silent = asyncio.run(poll())
        assert silent is not None and silent.steps == 40 and silent.scraped_at == answered_at
        assert silent.unanswered == 4 and silent.fresh_until is not None and silent.fresh_until < now[0]
        assert scrape_failures() == failures + 4
        assert woken == [key]  # a silence wakes nobody: the planner's own requeue comes at the deadline

        page.status = 200  # the same count, answered again
        now[0] += timedelta(seconds=15)
        fresh = asyncio.run(poll())
    assert fresh is not None and fresh.scraped_at == now[0] and fresh.unanswered == 0
    assert fresh.stepped_since == first.stepped_since  # the same reporter and count: its clock runs on
    assert woken == [key, key]  # the answer that ends a silence wakes the job to be judged


# -- a verdict needs a sample taken after the deadline ----------------------------------------


def test_a_sample_taken_before_the_deadline_is_no_verdict() -> None:
    """The newest sample shows the count as of its scrape: one taken before ``stepped_since +
    deadline`` cannot tell whether the worker stepped since (a slow scrape round, a busy poller),
    however fresh it still is. The job waits for a newer one."""
    world = hang_job(deadline=30)
    reporting(world, 40, world.now)  # fresh for 45 s: longer than the deadline
    world.advance(29)
    answered(world)  # the last scrape before the deadline, count unchanged
    world.advance(30)  # past the deadline by far, and that sample is still fresh
    waiting = world.reconcile()
    assert world.status["phase"] == "Running" and world.status["restarts"] == 0, world.status
    assert not waiting.delete and waiting.requeue_after is not None and 0 < waiting.requeue_after <= 45
    assert conditions(world)["Stalled"][0] == "False"  # nothing stale: the next scrape is simply awaited
    answered(world)  # a scrape taken past the deadline, the count still 40: now it is a hang
    world.reconcile()
    assert world.status["reason"] == "NoProgress" and world.status["restarts"] == 1


def test_the_first_scrape_after_the_deadline_wakes_the_job_to_be_judged() -> None:
    page = TextPage("phalanx_worker_steps_total 40\n")
    jobs, children = JobCache(), ChildCache()
    running_job_and_worker(jobs, children, ip="127.0.0.1", port=page.port)
    key = ("ml", "demo")
    body = jobs.get(key)
    assert body is not None
    jobs.update({**body, "spec": {"failurePolicy": {"progressDeadlineSeconds": 30}}})
    now = [datetime(2026, 12, 1, 8, 0, tzinfo=UTC)]
    woken: list[tuple[str, str]] = []
    poller = ProgressPoller(jobs, children, woken.append, interval=10, timeout=0.5, clock=lambda: now[0])

    async def poll() -> None:
        async with poller:
            await poller.poll_once()

    with page:
        for _ in range(6):  # at 0, 10, 20, 30, 40, 50 s: the count stays at 40
            asyncio.run(poll())
            now[0] += timedelta(seconds=10)
    assert woken == [key, key]  # its first sample, and the one scraped at 30 s, the first a verdict can rest on


# -- a busy cluster: endpoints of other jobs that never answer ---------------------------------

SCALE = 20
"""Seconds of the planner's clock per second of this test: its 30 s deadline (the least the schema
allows) is 1.5 s here, a poll interval of 0.5 s is 10 s."""


def test_thirty_jobs_whose_endpoints_never_answer_do_not_restart_a_job_that_steps() -> None:
    interval = timeout = 0.5
    world = hang_job(deadline=30)
    attempt, began = world.status["attempt"], world.now
    reporter = world.workers(attempt=attempt)[0]["metadata"]["uid"]
    port = free_port()
    stepping = WorkerMetrics()
    stepping.serve(port)
    jobs, children = JobCache(), ChildCache()
    running_job_and_worker(jobs, children, ip="127.0.0.1", port=port)
    key = ("ml", "demo")
    asked: list[str] = []

    async def never(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        await asyncio.Event().wait()  # accepts, and never answers
        raise AssertionError("unreachable")

    async def scenario() -> list[datetime]:
        app = web.Application()
        app.router.add_get("/metrics", never)
        async with serving(app) as base:
            silent = urlsplit(base).port
            assert silent is not None
            for index in range(30):
                namespace = "tenant" if index < 20 else "ml"  # another namespace's, and its own namespace's
                name, uid = f"silent-{index}", f"uid-silent-{index}"
                jobs.update(
                    {"metadata": {"namespace": namespace, "name": name, "uid": uid, "resourceVersion": "1"},
                     "status": {"phase": "Running", "attempt": 1}}
                )  # fmt: skip
                children.observe("ADDED", worker_pod(name, uid, silent, namespace=namespace))
            poller = ProgressPoller(jobs, children, lambda key: None, interval=interval, timeout=timeout)
            started = datetime.now(UTC)

            def planners(at: datetime | None) -> datetime | None:
                """A time of this test on the planner's clock."""
                return began + (at - started) * SCALE if at is not None else None

            scraped: list[datetime] = [started]
            task = asyncio.create_task(poller.run())
            try:
                while datetime.now(UTC) - started < timedelta(seconds=4):
                    stepping.step_done(0)  # the job trains on
                    await asyncio.sleep(0.05)
                    sample = poller.get(key)
                    if sample is None or sample.scraped_at is None:
                        continue
                    if sample.scraped_at != scraped[-1]:
                        scraped.append(sample.scraped_at)
                    world.now = planners(datetime.now(UTC)) or world.now
                    world.progress = replace(
                        sample,
                        attempt=attempt,
                        reporter=reporter,
                        stepped_since=planners(sample.stepped_since),
                        scraped_at=planners(sample.scraped_at),
                        fresh_until=planners(sample.fresh_until),
                    )
                    world.reconcile()
                    assert world.status["phase"] == "Running", world.status.get("message")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            return scraped

    try:
        scraped = asyncio.run(scenario())
    finally:
        stepping.close()
    assert world.status["restarts"] == 0
    assert len(asked) >= 30  # every silent endpoint was asked, and held its scrape open
    gaps = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(scraped)]
    assert len(gaps) >= 4 and max(gaps) < 30 / SCALE, gaps  # its samples stay fresher than the deadline
