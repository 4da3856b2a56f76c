from __future__ import annotations

from phalanx.reconcile.stages.suspension import suspension
from tests.unit.jobs import job
from tests.unit.simulation import World, running
from tests.unit.stages.drafts import decided, reaching, went_on


def test_a_suspended_job_stops_every_pod() -> None:
    world = running(World(job()))
    world.body["spec"]["suspend"] = True
    decision = decided(suspension(reaching(world, suspension)))
    assert (decision.view.phase, [event.reason for event in decision.actions.events]) == ("Suspended", ["Suspended"])
    assert {deletion.name for deletion in decision.actions.delete} == set(world.pods)


def test_a_resumed_job_starts_a_new_attempt_with_a_new_start() -> None:
    world = running(World(job()))
    world.status["phase"] = "Suspended"
    before = reaching(world, suspension)
    draft = went_on(suspension(before))
    assert draft.memory.attempt == before.memory.attempt + 1 and draft.memory.start_time is None
    assert [event.reason for event in draft.actions.events] == ["Resumed"]


def test_a_job_neither_suspended_nor_resumed_goes_on_unchanged() -> None:
    draft = reaching(running(World(job())), suspension)
    assert suspension(draft) is draft
