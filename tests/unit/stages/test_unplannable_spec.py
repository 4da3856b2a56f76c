from __future__ import annotations

from phalanx.reconcile.stages.unplannable_spec import unplannable_spec
from tests.unit.jobs import job
from tests.unit.simulation import World
from tests.unit.stages.drafts import decided, reaching, went_on

SUPERVISED = ["phalanx-supervise", "--", "torchrun"]


def test_the_launch_is_resolved_and_says_whether_gang_restarts_keep_pods() -> None:
    containers = [{"name": "trainer", "image": "example/train:1", "command": SUPERVISED}]
    world = World(job(template={"spec": {"containers": containers}}))
    draft = went_on(unplannable_spec(reaching(world, unplannable_spec)))
    assert draft.launch.supervised and draft.context.in_place and draft.refusal == ""


def test_spares_a_job_that_never_trained_cannot_have_fail_it() -> None:
    world = World(job(workers={"min": 2, "max": 4, "desired": 3, "spares": 1}))
    decision = decided(unplannable_spec(reaching(world, unplannable_spec)))
    assert (decision.view.phase, decision.view.reason) == ("Failed", "InvalidSpec")
    assert decision.view.message.startswith("spec.workers.spares: spares need")
