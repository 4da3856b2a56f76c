from __future__ import annotations

from dataclasses import replace

from phalanx.reconcile.stages.nodes_and_stale_pods import nodes_and_stale_pods
from tests.unit.jobs import job
from tests.unit.simulation import World, running
from tests.unit.stages.drafts import reaching, went_on


def test_the_attempts_workers_are_current_and_an_older_attempts_are_deleted() -> None:
    world = running(World(job()))
    draft = went_on(nodes_and_stale_pods(reaching(world, nodes_and_stale_pods)))
    assert [pod.name for pod in draft.current] == [f"demo-worker-{index}" for index in range(3)]
    assert draft.stale == () and draft.actions.delete == ()
    later = reaching(world, nodes_and_stale_pods)
    later = replace(later, memory=replace(later.memory, attempt=later.memory.attempt + 1))
    moved_on = went_on(nodes_and_stale_pods(later))
    assert moved_on.current == () and moved_on.moving == () and len(moved_on.stale) == 3
    assert {deletion.name for deletion in moved_on.actions.delete} == {pod.name for pod in moved_on.stale}


def test_a_pod_on_a_deleted_node_is_force_deleted() -> None:
    world = running(World(job()))
    world.deleted_nodes.add("node-a")
    world.pods["demo-worker-0"]["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"
    draft = went_on(nodes_and_stale_pods(reaching(world, nodes_and_stale_pods)))
    forced = [deletion for deletion in draft.actions.delete if deletion.name == "demo-worker-0"]
    assert [deletion.grace_seconds for deletion in forced] == [0]
