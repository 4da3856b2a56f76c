"""Drafts for the stage tests: a job's draft as it reaches a stage, built by the stages before it."""

from __future__ import annotations

from phalanx.reconcile.decide import STAGES
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.stages.draft import Draft, Stage
from tests.unit.simulation import World


def reaching(world: World, stage: Stage) -> Draft:
    """The world's draft as ``stage`` receives it: every stage before it went on."""
    draft = Draft.of(world.job, world.observed(), world.now)
    for earlier in STAGES[: STAGES.index(stage)]:
        draft = went_on(earlier(draft))
    return draft


def went_on(outcome: Draft | Decision) -> Draft:
    assert isinstance(outcome, Draft), f"the pass ended: {outcome}"
    return outcome


def decided(outcome: Draft | Decision) -> Decision:
    assert isinstance(outcome, Decision), "the pass went on"
    return outcome
