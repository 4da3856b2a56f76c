"""Status writes that only report progress wait a moment; decisions are written at once."""

from __future__ import annotations

from phalanx.cluster.status_pacing import StatusPacer
from phalanx.reconcile.plan import progress_only
from tests.unit.jobs import job
from tests.unit.simulation import World


def started_world() -> World:
    world = World(job(workers={"min": 3, "max": 3, "desired": 3}))
    world.reconcile()
    return world


def test_workers_becoming_ready_one_by_one_is_progress_and_running_is_a_decision() -> None:
    world = started_world()
    world.run("demo-rdzv")
    world.reconcile()
    world.run("demo-worker-0")
    assert not progress_only(world.status, world.plan().status)  # Pending -> Starting
    world.reconcile()
    before = world.status
    assert before["phase"] == "Starting"
    world.run("demo-worker-1")
    proposed = world.plan().status
    assert proposed["workers"]["ready"] == 2 and proposed["message"] != before["message"]
    assert progress_only(before, proposed), (before, proposed)

    world.run("demo-worker-2")
    proposed = world.plan().status
    assert proposed["phase"] == "Running"
    assert not progress_only(before, proposed)  # a new phase is never held back


def test_a_new_desired_count_is_a_decision_the_next_pass_reads_back() -> None:
    current = {"phase": "Running", "reason": "Running", "workers": {"desired": 3, "active": 3, "ready": 3}}
    assert progress_only(current, {"phase": "Running", "workers": {"desired": 3, "active": 3, "ready": 2}})
    assert not progress_only(current, {"phase": "Running", "workers": {"desired": 4, "active": 3, "ready": 3}})


def test_counted_failures_attempts_and_condition_verdicts_are_decisions() -> None:
    ready = {"type": "Ready", "status": "True", "reason": "Running", "message": "3/3 ready"}
    current = {"phase": "Running", "attempt": 0, "restarts": 0, "conditions": [ready]}
    assert progress_only(current, {"conditions": [{**ready, "message": "2/3 ready"}]})
    assert not progress_only(current, {"conditions": [{**ready, "status": "False"}]})
    assert not progress_only(current, {"restarts": 1, "countedFailures": ["uid-1"]})
    assert not progress_only(current, {"attempt": 1})
    assert not progress_only(current, {"phase": "Restarting"})


def test_a_removal_recorded_is_a_decision_and_forgetting_a_gone_pod_can_wait() -> None:
    """The record must be written before the deletions it covers; a UID pruned once its pod is gone
    costs no write of its own (UIDs are never reused)."""
    current = {"phase": "Running", "removedWorkers": ["uid-1", "uid-2"]}
    assert not progress_only(current, {"removedWorkers": ["uid-1", "uid-2", "uid-3"]})
    assert not progress_only({"phase": "Running"}, {"removedWorkers": ["uid-3"]})
    assert progress_only(current, {"removedWorkers": ["uid-2"]})
    assert progress_only(current, {"removedWorkers": None})


def test_the_pacer_lets_one_progress_write_through_per_interval() -> None:
    now = [100.0]
    pacer = StatusPacer(interval=1.0, clock=lambda: now[0])
    key = ("ml", "demo")
    assert pacer.hold(key) == 0.0  # never written: at once
    pacer.wrote(key)
    now[0] += 0.25
    assert pacer.hold(key) == 0.75
    now[0] += 0.75
    assert pacer.hold(key) == 0.0
    pacer.forget(key)
    assert pacer.hold(key) == 0.0


def test_a_busy_operator_holds_progress_longer() -> None:
    now, busy = [0.0], [True]
    pacer = StatusPacer(interval=5.0, busy_interval=30.0, busy=lambda: busy[0], clock=lambda: now[0])
    key = ("ml", "demo")
    pacer.wrote(key)
    now[0] = 6.0
    assert pacer.hold(key) == 24.0  # jobs wait in the queue: creating their pods comes first
    busy[0] = False
    assert pacer.hold(key) == 0.0


def test_a_starting_job_reports_its_counts_less_often_than_a_running_one() -> None:
    now = [0.0]
    pacer = StatusPacer(interval=5.0, startup_interval=15.0, clock=lambda: now[0])
    key = ("ml", "demo")
    pacer.wrote(key)
    now[0] = 6.0
    assert pacer.hold(key) == 0.0
    assert pacer.hold(key, starting=True) == 9.0
