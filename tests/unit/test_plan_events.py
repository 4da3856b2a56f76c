"""Events of per-worker replacements: one Worker<Reason> event naming the worker."""

from __future__ import annotations

import pytest

from phalanx.reconcile.restarts import worker_event_reason
from tests.unit.jobs import job
from tests.unit.simulation import World


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("WorkerFailed", "WorkerFailed"),
        ("OOMKilled", "WorkerOOMKilled"),
        ("Evicted", "WorkerEvicted"),
        ("Preempted", "WorkerPreempted"),
        ("NodeLost", "WorkerNodeLost"),
    ],
)
def test_worker_event_reason_never_doubles_the_prefix(reason: str, expected: str) -> None:
    assert worker_event_reason(reason) == expected


def test_an_application_error_is_reported_as_worker_failed() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.terminate("demo-worker-1", 1, "Error", "ValueError: bad batch")
    plan = world.reconcile()
    assert [(event.type, event.reason) for event in plan.events] == [("Warning", "WorkerFailed")]
    assert "demo-worker-1" in plan.events[0].message
    assert "ValueError: bad batch" in plan.events[0].message


def test_an_oom_kill_is_reported_as_worker_oom_killed() -> None:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    world.terminate("demo-worker-2", 137, "OOMKilled")
    plan = world.reconcile()
    assert [(event.type, event.reason) for event in plan.events] == [("Warning", "WorkerOOMKilled")]
