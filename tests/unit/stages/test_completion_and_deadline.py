from __future__ import annotations

from phalanx.reconcile.stages.completion_and_deadline import completion_and_deadline
from tests.unit.jobs import job
from tests.unit.simulation import World, running
from tests.unit.stages.drafts import decided, reaching, went_on


def test_a_worker_that_exited_0_ends_the_job_in_success() -> None:
    world = running(World(job()))
    world.terminate("demo-worker-1", 0)
    decision = decided(completion_and_deadline(reaching(world, completion_and_deadline)))
    assert (decision.view.phase, decision.view.message) == ("Succeeded", "training completed")


def test_the_active_deadline_is_waited_for_then_fails_the_job() -> None:
    world = running(World(job(activeDeadlineSeconds=60)))
    draft = went_on(completion_and_deadline(reaching(world, completion_and_deadline)))
    assert 0 < min(draft.actions.requeue) <= 60
    world.advance(61)
    decision = decided(completion_and_deadline(reaching(world, completion_and_deadline)))
    assert (decision.view.phase, decision.view.reason) == ("Failed", "DeadlineExceeded")
