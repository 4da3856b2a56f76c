from __future__ import annotations

from phalanx.reconcile.stages.placement import placement
from tests.unit.jobs import job
from tests.unit.simulation import World, running
from tests.unit.stages.drafts import decided, reaching, went_on


def test_a_job_without_topology_is_placed_in_no_domain() -> None:
    draft = went_on(placement(reaching(running(World(job())), placement)))
    assert draft.memory.domain is None and draft.actions.events == ()


def test_a_gang_no_domain_can_hold_waits_pending_before_any_worker_runs() -> None:
    world = World(job(placement={"topology": {"key": "zone"}}))
    world.node_allocatable = {"node-0": {"cpu": "1", "memory": "1Gi"}}
    world.node_labels = {"node-0": {"zone": "a"}}
    decision = decided(placement(reaching(world, placement)))
    assert decision.view.phase == "Pending" and decision.stall is not None
