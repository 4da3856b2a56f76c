"""Where a job's time went (status.timeByState): each state's seconds are added once, when the job
leaves it, from the previous status and the pass's time; recovery runs from a gang restart until the
job trains again and is kept by its cause."""

from __future__ import annotations

from datetime import datetime, timedelta

from prometheus_client import CollectorRegistry

from phalanx import metrics
from phalanx.api import v1alpha1 as api
from phalanx.reconcile.goodput import effective_training_ratio, seconds_by_state
from phalanx.reconcile.observed import WorkerProgress
from phalanx.reconcile.status import format_time, parse_time
from tests.unit.jobs import job
from tests.unit.simulation import START, World


def counts(world: World) -> dict[str, object]:
    return {k: v for k, v in world.status["timeByState"].items() if k not in ("since",)}


def test_queued_starting_training_recovering_by_cause_and_suspended_each_add_up_once() -> None:
    world = World(job(workers={"min": 3, "desired": 3}, failurePolicy={"backoffSeconds": 10}))
    world.reconcile()
    created = world.body["metadata"]["creationTimestamp"]
    assert world.status["timeByState"]["state"] == "queued" and world.status["timeByState"]["since"] == created
    started = parse_time(created)
    assert started is not None
    before_first_pass = int((START - started).total_seconds())  # queued before the operator saw it
    world.advance(5)
    world.settle()
    world.advance(7)
    for name in list(world.pods):
        world.schedule_only(name)
    world.reconcile()
    assert world.status["phase"] == "Starting" and world.status["timeByState"]["state"] == "starting"
    world.advance(3)
    world.run()
    world.reconcile()
    assert counts(world) == {
        "queued": before_first_pass + 12,
        "starting": 3,
        "training": 0,
        "recovering": 0,
        "suspended": 0,
        "state": "training",
    }

    world.advance(100)
    world.terminate("demo-worker-1", 1)  # too few survivors: the gang restarts
    world.reconcile()
    state = world.status["timeByState"]
    assert (state["state"], state["cause"], state["training"]) == ("recovering", "WorkerFailed", 100)
    world.advance(10)  # the backoff, the old pods stopping, the new ones queued and starting
    world.finish_terminating()
    world.settle()
    world.advance(4)
    world.run()
    world.settle()
    assert world.status["phase"] == "Running"
    state = world.status["timeByState"]
    assert (state["recovering"], state["recoveringByCause"], state["state"]) == (14, {"WorkerFailed": 14}, "training")
    assert "cause" not in state

    unchanged = world.reconcile()  # a pass that changes no state writes nothing of it
    assert "timeByState" not in unchanged.status and world.status["timeByState"] == state

    world.advance(50)
    world.body["spec"]["suspend"] = True
    world.settle()
    world.advance(30)
    world.body["spec"]["suspend"] = False
    world.reconcile()
    state = world.status["timeByState"]
    assert (state["training"], state["suspended"], state["state"]) == (150, 30, "queued")


def test_the_end_closes_the_last_state_and_nothing_is_added_after() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.advance(60)
    world.terminate("demo-worker-0", 0)
    world.reconcile()
    assert world.status["phase"] == "Succeeded"
    state = world.status["timeByState"]
    assert state["training"] == 60 and "state" not in state and "since" not in state
    world.advance(600)
    world.reconcile()
    assert world.status["timeByState"] == state


def test_seconds_up_to_now_include_the_current_state_and_the_ratio_leaves_suspension_out() -> None:
    since = START + timedelta(seconds=100)
    counts = api.TimeByState(
        queued=10,
        training=80,
        recovering=20,
        recovering_by_cause={"NodeLost": 20},
        suspended=500,
        state="training",
        since=format_time(since),
    )
    now = since + timedelta(seconds=10)
    assert seconds_by_state(counts, now) == {
        ("queued", ""): 10.0,
        ("starting", ""): 0.0,
        ("training", ""): 90.0,
        ("recovering", "NodeLost"): 20.0,
        ("suspended", ""): 500.0,
    }
    assert effective_training_ratio(counts, now) == 90 / 120


def test_the_operator_exports_time_by_state_as_of_the_scrape() -> None:
    now = START + timedelta(seconds=130)
    collector = metrics.JobTimeCollector(clock=lambda: now)
    registry = CollectorRegistry()
    registry.register(collector)
    time_by_state = {
        "queued": 10,
        "training": 60,
        "recovering": 30,
        "recoveringByCause": {"WorkerFailed": 30},
        "state": "recovering",
        "cause": "NodeLost",
        "since": format_time(START + timedelta(seconds=100)),
    }
    collector.observe(("ml", "llama"), {"timeByState": time_by_state, "recomputedSteps": {"total": 42}})
    sample = registry.get_sample_value
    labels = {"namespace": "ml", "name": "llama"}
    assert sample("phalanx_job_state_seconds_total", {**labels, "state": "training", "cause": ""}) == 60
    assert sample("phalanx_job_state_seconds_total", {**labels, "state": "recovering", "cause": "WorkerFailed"}) == 30
    assert sample("phalanx_job_state_seconds_total", {**labels, "state": "recovering", "cause": "NodeLost"}) == 30
    assert sample("phalanx_job_effective_training_ratio", labels) == 60 / 130
    assert sample("phalanx_job_recomputed_steps_total", labels) == 42
    collector.observe(("ml", "llama"), {"timeByState": {"state": "no such state"}})  # another version's: kept
    assert sample("phalanx_job_state_seconds_total", {**labels, "state": "training", "cause": ""}) == 60
    collector.forget(("ml", "llama"))
    assert sample("phalanx_job_effective_training_ratio", labels) is None
    assert sample("phalanx_job_recomputed_steps_total", labels) is None


def progress(step: int, resumed: int, began: datetime, attempt: int = 0) -> WorkerProgress:
    return WorkerProgress(attempt=attempt, step=step, resumed_step=resumed, run_started=began, steps=step - resumed)


def test_steps_computed_again_are_the_reached_step_less_the_one_the_new_run_resumed_at_counted_once() -> None:
    world = World(job(workers={"min": 3, "desired": 3}, failurePolicy={"backoffSeconds": 0}))
    world.settle()
    world.run()
    world.reconcile()
    world.progress = progress(137, 100, START - timedelta(minutes=5))  # checkpoints every 10 steps: one at 130
    world.reconcile()
    assert "recomputedSteps" not in world.status
    world.terminate("demo-worker-1", 1)  # too few survivors: the gang restarts
    world.reconcile()
    failed_at = format_time(world.now)
    assert world.status["recomputedSteps"] == {"total": 0, "reached": 137, "failedAt": failed_at}
    world.advance(5)
    world.finish_terminating()
    world.settle()
    world.reconcile()  # the old run's page, scraped before the restart, changes nothing
    assert world.status["recomputedSteps"]["reached"] == 137
    world.run()
    world.progress = progress(131, 130, world.now, attempt=1)  # the new run resumed at 130
    world.reconcile()
    assert world.status["recomputedSteps"] == {"total": 7}
    world.reconcile()
    assert world.status["recomputedSteps"] == {"total": 7}  # once

    # a worker replaced while the others train on: their processes restart from the checkpoint too
    world.progress = progress(158, 130, world.now - timedelta(seconds=1), attempt=1)
    world.advance(30)
    world.terminate("demo-worker-0", 1)
    world.body["spec"]["workers"]["min"] = 1
    world.reconcile()
    assert world.status["recomputedSteps"]["reached"] == 158
    world.progress = progress(151, 150, world.now + timedelta(seconds=2), attempt=1)
    world.reconcile()
    assert world.status["recomputedSteps"] == {"total": 15}


def test_a_restart_whose_run_never_comes_recomputes_nothing() -> None:
    world = World(job(workers={"min": 3, "desired": 3}, failurePolicy={"backoffSeconds": 0, "maxRestarts": 1}))
    world.settle()
    world.run()
    world.reconcile()
    world.progress = progress(42, 40, START - timedelta(minutes=1))
    world.reconcile()
    world.terminate("demo-worker-1", 1)  # the gang restarts
    world.reconcile()
    assert world.status["recomputedSteps"]["reached"] == 42
    world.finish_terminating()
    world.settle()
    world.run()
    world.terminate("demo-worker-0", 1)  # before the new run reported: the budget is spent, the job fails
    world.reconcile()
    assert world.status["phase"] == "Failed"
    assert world.status["recomputedSteps"] == {"total": 0}


def test_without_a_step_from_the_workers_nothing_is_counted() -> None:
    world = World(job(workers={"min": 3, "desired": 3}, failurePolicy={"backoffSeconds": 0}))
    world.settle()
    world.run()
    world.reconcile()
    world.terminate("demo-worker-1", 1)
    world.reconcile()
    assert "recomputedSteps" not in world.status


def test_a_job_an_older_operator_ran_is_counted_from_now_not_from_its_creation() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    del world.body["status"]["timeByState"]  # as an operator without time by state left it
    world.advance(3600)
    world.reconcile()
    assert world.status["timeByState"] == {
        "queued": 0,
        "starting": 0,
        "training": 0,
        "recovering": 0,
        "suspended": 0,
        "state": "training",
        "since": format_time(world.now),
    }
