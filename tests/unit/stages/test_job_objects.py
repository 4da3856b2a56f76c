from __future__ import annotations

from phalanx.reconcile import naming
from phalanx.reconcile.stages.job_objects import job_objects
from tests.unit.jobs import job
from tests.unit.simulation import World
from tests.unit.stages.drafts import reaching, went_on


def test_the_store_and_services_are_planned_and_a_podgroup_only_for_a_gang_scheduler() -> None:
    draft = went_on(job_objects(reaching(World(job()), job_objects)))
    children = draft.children
    assert children.store["metadata"]["name"] == naming.rendezvous_name("demo")
    assert children.pod_group is None and children.device_claim_template is None
    assert children.services[0] is not None
    gang = went_on(job_objects(reaching(World(job(gang={"scheduler": "scheduler-plugins"})), job_objects)))
    group = gang.children.pod_group
    assert group is not None and group["kind"] == "PodGroup"
