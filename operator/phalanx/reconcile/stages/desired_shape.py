"""Stage: the worker slots the job should have, once its store exists."""

from __future__ import annotations

from dataclasses import replace

from phalanx.reconcile.creation import Wanted
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.phase import scaling
from phalanx.reconcile.stages.draft import Draft


def desired_shape(draft: Draft) -> Draft | Decision:
    """Empty slots below desired filled (ready spares first), the surplus removed (``scaling``)."""
    if draft.context.observed.store() is None:
        return draft
    scaled = scaling(draft.context, draft.memory, draft.launch, list(draft.current))
    return replace(
        draft,
        wanted=draft.wanted + tuple(Wanted(worker, create_only=True) for worker in scaled.slots),
        actions=draft.actions + scaled.actions,
        scaled=scaled,
    )
