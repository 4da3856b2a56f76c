"""Stage: failures fail the job, replace workers or restart the gang; else a hang restarts it."""

from __future__ import annotations

from dataclasses import replace

from phalanx.reconcile import replica_groups
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.restarts import handle_failures, no_progress
from phalanx.reconcile.stages.draft import Draft


def failures_and_hangs(draft: Draft) -> Draft | Decision:
    """Failed workers, as ``handle_failures`` decides (fatal ones end the job, others replace the
    workers or restart the gang), then a job that makes no progress (``no_progress``)."""
    context, current = draft.context, list(draft.current)
    # pods of a replica group's older generation (a pass stopped after recording the restart) go
    # uncounted, never judged as failures
    stale = replica_groups.stale_generations(context, draft.memory, current)
    current = [pod for pod in current if pod not in stale]
    step = handle_failures(context, draft.memory, current)
    step = replace(step, actions=context.removing(stale) + step.actions)
    if step.view is None:
        hang = no_progress(context, step.memory, current)
        step = replace(hang, actions=step.actions + hang.actions)
    actions = draft.actions + step.actions
    if step.view is not None:
        return Decision(step.view, step.memory, actions, stall=step.stall)
    return replace(draft, memory=step.memory, actions=actions, stall=step.stall)
