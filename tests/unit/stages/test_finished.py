from __future__ import annotations

from phalanx.reconcile.stages.finished import finished
from tests.unit.jobs import job
from tests.unit.simulation import World, running
from tests.unit.stages.drafts import decided, reaching


def test_a_job_that_runs_goes_on_unchanged() -> None:
    draft = reaching(running(World(job())), finished)
    assert finished(draft) is draft


def test_a_succeeded_job_is_deleted_once_its_ttl_has_passed_and_waits_for_it_before() -> None:
    world = running(World(job(ttlSecondsAfterFinished=600)))
    world.terminate("demo-worker-0", 0)
    world.reconcile()
    assert world.status["phase"] == "Succeeded"
    waiting = decided(finished(reaching(world, finished)))
    assert waiting.view.phase == "Succeeded" and not waiting.delete_job
    world.advance(601)
    assert decided(finished(reaching(world, finished))).delete_job
