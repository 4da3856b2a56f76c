from __future__ import annotations

from datetime import timedelta

from phalanx.reconcile.stages.held_back import held_back
from phalanx.reconcile.status import format_time
from tests.unit.jobs import job
from tests.unit.simulation import World, running
from tests.unit.stages.drafts import decided, reaching


def test_a_running_job_is_not_held_back() -> None:
    draft = reaching(running(World(job())), held_back)
    assert held_back(draft) is draft


def test_the_restart_backoff_holds_the_workers_and_the_pass_comes_back_when_it_ends() -> None:
    world = running(World(job()))
    world.status["restartNotBefore"] = format_time(world.now + timedelta(seconds=30))
    decision = decided(held_back(reaching(world, held_back)))
    assert (decision.view.phase, decision.view.reason) == ("Restarting", "Backoff")
    assert decision.view.message.endswith(f"starts at {format_time(world.now + timedelta(seconds=30))}")
    assert 30.0 in decision.actions.requeue


def test_a_missing_podgroup_holds_the_workers_but_its_objects_are_written() -> None:
    world = World(job(gang={"scheduler": "scheduler-plugins"}))
    world.reconcile()
    world.objects = {key: obj for key, obj in world.objects.items() if obj["kind"] != "PodGroup"}
    decision = decided(held_back(reaching(world, held_back)))
    assert decision.view.reason == "WaitingForPodGroup"
    assert "PodGroup" in {obj["kind"] for obj in decision.apply}
