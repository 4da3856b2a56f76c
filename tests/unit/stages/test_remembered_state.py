from __future__ import annotations

from datetime import timedelta

from phalanx.reconcile.stages.remembered_state import remembered_state
from phalanx.reconcile.status import format_time
from tests.unit.jobs import job
from tests.unit.simulation import START, World
from tests.unit.stages.drafts import reaching, went_on


def avoiding(*untils: timedelta) -> World:
    avoided = [
        {"node": f"node-{index}", "reason": "NodeFault", "message": "", "until": format_time(START + until)}
        for index, until in enumerate(untils)
    ]
    return World(job(status={"phase": "Running", "avoidedNodes": avoided}))


def test_an_avoidance_whose_time_passed_is_dropped_and_the_pass_comes_back_when_the_next_ends() -> None:
    draft = went_on(remembered_state(reaching(avoiding(timedelta(0), timedelta(seconds=90)), remembered_state)))
    assert draft.memory.avoided_nodes == ("node-1",)
    assert draft.memory.avoided[0].until == START + timedelta(seconds=90)
    assert draft.actions.requeue == (90.0,)


def test_without_avoided_nodes_nothing_is_asked() -> None:
    draft = went_on(remembered_state(reaching(avoiding(), remembered_state)))
    assert draft.memory.avoided == () and draft.actions.requeue == ()
