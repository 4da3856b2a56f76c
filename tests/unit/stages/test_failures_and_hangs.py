from __future__ import annotations

from phalanx.reconcile.stages.failures_and_hangs import failures_and_hangs
from tests.unit.jobs import job
from tests.unit.simulation import World, running
from tests.unit.stages.drafts import decided, reaching, went_on


def test_healthy_workers_go_on_with_the_memory_as_it_was() -> None:
    draft = reaching(running(World(job())), failures_and_hangs)
    after = went_on(failures_and_hangs(draft))
    assert after.memory == draft.memory and after.stall is None


def test_a_failed_worker_above_min_is_counted_and_replaced_and_the_pass_goes_on() -> None:
    world = running(World(job()))
    world.terminate("demo-worker-2", 1)
    draft = went_on(failures_and_hangs(reaching(world, failures_and_hangs)))
    assert draft.memory.restarts == 1 and [deletion.name for deletion in draft.actions.delete] == ["demo-worker-2"]
    assert [event.reason for event in draft.actions.events] == ["WorkerFailed"]


def test_a_failure_beyond_the_restart_budget_fails_the_job() -> None:
    world = running(World(job(failurePolicy={"maxRestarts": 0})))
    world.terminate("demo-worker-2", 1)
    decision = decided(failures_and_hangs(reaching(world, failures_and_hangs)))
    assert (decision.view.phase, decision.view.reason) == ("Failed", "RestartBudgetExhausted")
