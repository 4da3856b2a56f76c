"""Stage: the warm spares tended, once the workers' slots are decided."""

from __future__ import annotations

from dataclasses import replace

from phalanx.reconcile import spares
from phalanx.reconcile.creation import Wanted
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.stages.draft import Draft


def spare_upkeep(draft: Draft) -> Draft | Decision:
    """Failed spares recorded and removed, extra ones removed, and the missing ones created once
    every slot holds a worker bound to a node (``spares.upkeep``)."""
    scaled = draft.scaled
    if scaled is None:  # no store yet: no slot was decided
        return draft
    kept = spares.upkeep(draft.context, draft.memory, draft.launch, promoted=scaled.promoted, may_create=scaled.placed)
    return replace(
        draft,
        memory=kept.memory,
        wanted=draft.wanted + tuple(Wanted(spare, create_only=True) for spare in kept.create),
        actions=draft.actions + kept.actions,
    )
