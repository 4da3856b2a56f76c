"""Stage: the remembered state brought up to now."""

from __future__ import annotations

from dataclasses import replace

from phalanx.reconcile.actions import requeue
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.stages.draft import Draft


def remembered_state(draft: Draft) -> Draft | Decision:
    """Nodes whose avoidance has passed are dropped (the pass comes back when the next one ends),
    and the steps a restart cost are counted once its new run reports."""
    context = draft.context
    memory = draft.memory.avoiding_until(context.now).resumed(context.observed.progress)
    actions = draft.actions
    if memory.avoided:  # status drops the node when its time is up
        ends = min(entry.until for entry in memory.avoided)
        actions += requeue(max(0.0, (ends - context.now).total_seconds()))
    return replace(draft, memory=memory, actions=actions)
