"""Stage: a finished job winds down and waits for its TTL."""

from __future__ import annotations

from datetime import timedelta

from phalanx.reconcile.actions import requeue
from phalanx.reconcile.pass_values import Context, Decision, Memory, wind_down
from phalanx.reconcile.stages.draft import Draft
from phalanx.reconcile.status import TERMINAL, PhaseView


def finished(draft: Draft) -> Draft | Decision:
    """A job that succeeded or failed stops what still runs and is deleted when its TTL has passed."""
    if draft.context.job.status.phase in TERMINAL:
        return after_finish(draft.context, draft.memory)
    return draft


def after_finish(context: Context, memory: Memory) -> Decision:
    """A finished job: stop what still runs, and delete the job when its TTL has passed."""
    previous = context.job.status
    completed = memory.completion_time
    if previous.phase == "Succeeded" and completed is not None:
        actions = wind_down(context, completed)
    else:
        actions = context.removing_active()
    delete_job = False
    ttl = context.spec.ttl_seconds_after_finished
    if ttl is not None and completed is not None:
        remaining = (completed + timedelta(seconds=ttl) - context.now).total_seconds()
        if remaining <= 0:
            delete_job = True
        else:
            actions += requeue(remaining)
    assert previous.phase in TERMINAL
    view = PhaseView(previous.phase, previous.reason or previous.phase, previous.message or "")
    return Decision(view, memory, actions, delete_job=delete_job)
