from __future__ import annotations

from phalanx.reconcile.stages.workers_phase import workers_phase
from tests.unit.jobs import job
from tests.unit.simulation import World, running
from tests.unit.stages.drafts import decided, reaching


def test_running_workers_give_the_running_phase() -> None:
    decision = decided(workers_phase(reaching(running(World(job())), workers_phase)))
    assert (decision.view.phase, decision.view.reason) == ("Running", "WorkersReady")
    assert decision.rescaled is None


def test_the_workers_wanted_are_written_while_the_job_starts() -> None:
    world = World(job())
    world.reconcile()  # the store
    decision = decided(workers_phase(reaching(world, workers_phase)))
    assert {obj["metadata"]["name"] for obj in decision.apply if obj["kind"] == "Pod"} >= {"demo-worker-0"}
    assert decision.view.phase != "Running"
