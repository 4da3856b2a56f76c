from __future__ import annotations

from phalanx.reconcile.stages.spare_upkeep import spare_upkeep
from tests.unit.jobs import job
from tests.unit.simulation import World
from tests.unit.stages.drafts import reaching, went_on

SUPERVISED = ["phalanx-supervise", "--", "torchrun"]


def with_spare() -> World:
    containers = [{"name": "trainer", "image": "example/train:1", "command": SUPERVISED}]
    return World(job(template={"spec": {"containers": containers}}, workers={"min": 2, "desired": 3, "spares": 1}))


def test_no_spare_is_tended_before_the_slots_are_decided() -> None:
    draft = reaching(with_spare(), spare_upkeep)
    assert draft.scaled is None and spare_upkeep(draft) is draft


def test_a_spare_is_created_once_every_slot_holds_a_worker_on_a_node() -> None:
    world = with_spare()
    world.settle()
    world.run()
    draft = went_on(spare_upkeep(reaching(world, spare_upkeep)))
    spares = [wanted.obj for wanted in draft.wanted if wanted.obj["metadata"]["name"].startswith("demo-spare-")]
    assert len(spares) == 1 and all(wanted.create_only for wanted in draft.wanted if wanted.obj in spares)
