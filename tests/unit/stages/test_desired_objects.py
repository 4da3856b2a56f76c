from __future__ import annotations

from phalanx.reconcile import naming
from phalanx.reconcile.creation import Wanted
from phalanx.reconcile.stages.desired_objects import desired_objects
from tests.unit.jobs import job
from tests.unit.simulation import World, running
from tests.unit.stages.drafts import reaching, went_on


def names(wanted: tuple[Wanted, ...]) -> list[str]:
    return [one.obj["metadata"]["name"] for one in wanted]


def test_a_new_job_wants_its_services_and_store_and_a_running_one_no_new_store() -> None:
    fresh = went_on(desired_objects(reaching(World(job()), desired_objects)))
    assert not fresh.devices_missing
    pods = tuple(wanted for wanted in fresh.wanted if wanted.obj["kind"] == "Pod")
    assert names(pods) == [naming.rendezvous_name("demo")] and pods[0].create_only  # the store, created once
    settled = went_on(desired_objects(reaching(running(World(job())), desired_objects)))
    assert all(wanted.obj["kind"] != "Pod" for wanted in settled.wanted)
