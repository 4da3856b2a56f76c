from __future__ import annotations

from phalanx.reconcile import desired
from phalanx.reconcile.stages.missing_apis import missing_apis
from tests.unit.jobs import job
from tests.unit.simulation import World
from tests.unit.stages.drafts import decided, reaching


def test_a_podgroup_api_not_served_holds_the_job_pending_and_stalled() -> None:
    world = World(job(gang={"scheduler": "scheduler-plugins"}))
    draft = reaching(world, missing_apis)
    assert missing_apis(draft) is draft
    world.missing_apis[desired.COSCHEDULING_API] = "not served"
    decision = decided(missing_apis(reaching(world, missing_apis)))
    assert (decision.view.phase, decision.view.reason) == ("Pending", "GangSchedulerUnavailable")
    assert decision.stall is not None and decision.stall[0] == "GangSchedulerUnavailable"
