"""Stage: suspension stops every pod; resumption starts a new attempt."""

from __future__ import annotations

from dataclasses import replace

from phalanx.reconcile.actions import event
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.stages.draft import Draft
from phalanx.reconcile.status import PhaseView


def suspension(draft: Draft) -> Draft | Decision:
    """A suspended job stops all its pods; a resumed one starts a new attempt, with a new start."""
    context, memory, actions = draft.context, draft.memory, draft.actions
    if context.spec.suspend:
        actions += context.removing_active()
        if context.job.status.phase != "Suspended":
            actions += event("Normal", "Suspended", "job suspended: all pods stopped")
        return Decision(PhaseView("Suspended", "Suspended", "spec.suspend is true"), memory, actions)
    if context.job.status.phase != "Suspended":
        return draft
    # A resumed job starts a new rendezvous; suspension never costs budget, nor deadline:
    # as batch/v1 resets startTime on resume, activeDeadlineSeconds counts from the next start.
    memory = replace(memory, attempt=memory.attempt + 1, start_time=None)
    actions += event("Normal", "Resumed", f"job resumed as attempt {memory.attempt}")
    return replace(draft, memory=memory, actions=actions)
