from __future__ import annotations

from phalanx.reconcile.stages.desired_shape import desired_shape
from tests.unit.jobs import job
from tests.unit.simulation import World
from tests.unit.stages.drafts import reaching, went_on


def test_no_slot_is_decided_before_the_store_exists() -> None:
    draft = reaching(World(job()), desired_shape)
    assert desired_shape(draft) is draft


def test_once_the_store_exists_the_empty_slots_are_filled() -> None:
    world = World(job())
    world.reconcile()  # the store
    draft = went_on(desired_shape(reaching(world, desired_shape)))
    assert draft.scaled is not None and draft.scaled.rescaled is None
    workers = [wanted.obj["metadata"]["name"] for wanted in draft.wanted if wanted.obj["kind"] == "Pod"]
    assert workers == [f"demo-worker-{index}" for index in range(3)]
