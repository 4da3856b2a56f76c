"""Stage: training that completed ends the job; then the active deadline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta

from phalanx.reconcile.actions import requeue
from phalanx.reconcile.observed import PodRecord
from phalanx.reconcile.pass_values import Context, Decision, Memory, Step, concluded, finish
from phalanx.reconcile.stages.draft import Draft


def completion_and_deadline(draft: Draft) -> Draft | Decision:
    """A job whose training completed succeeds; one past activeDeadlineSeconds fails."""
    context, memory = draft.context, draft.memory
    completed = completion(context, memory, draft.current)
    if completed is not None:
        return concluded(draft.actions, finish(context, memory, "Succeeded", "Succeeded", completed))
    deadline = active_deadline(context, memory)
    if deadline.view is not None:
        return concluded(draft.actions, deadline)
    return replace(draft, actions=draft.actions + deadline.actions)


def completion(context: Context, memory: Memory, current: Sequence[PodRecord]) -> str | None:
    """Why training is known to have completed, or None.

    A worker of the current attempt that exited 0 says so, and so does the record a rank
    leaves in the rendezvous store when it finished every step: that one also holds when the
    rank then died in teardown and the agents are left waiting for a world that cannot form.
    Anything that reaches the store can write that key, so a record counts only when it names
    this job's UID and its current attempt.
    """
    # a worker stopped by a deletion or an eviction may exit 0 on SIGTERM: that is no success
    if any(pod.phase == "Succeeded" and not pod.deleting and pod.disruption_reason is None for pod in current):
        return "training completed"
    done = context.observed.completion
    if done is None or done.job_uid != context.job.metadata.uid or done.attempt != memory.attempt:
        return None
    where = f"rank {done.rank} recorded completion" if done.rank is not None else "completion was recorded"
    at = f" at step {done.step}" if done.step is not None else ""
    return f"training completed: {where}{at} (attempt {done.attempt}) in the rendezvous store"


def active_deadline(context: Context, memory: Memory) -> Step:
    """activeDeadlineSeconds, counted from the start of training (``startTime``)."""
    started = memory.start_time
    deadline = context.spec.active_deadline_seconds
    if deadline is None or started is None:
        return Step(memory)
    remaining = (started + timedelta(seconds=deadline) - context.now).total_seconds()
    if remaining <= 0:
        return finish(
            context, memory, "Failed", "DeadlineExceeded", f"job ran longer than activeDeadlineSeconds ({deadline})"
        )
    return Step(memory, requeue(remaining))
