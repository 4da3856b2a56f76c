"""Stage: a spec that cannot be planned stalls a running job, or fails one that runs nothing; one
that can no longer have spares is planned without them once the job has trained."""

from __future__ import annotations

from dataclasses import replace

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import desired
from phalanx.reconcile.actions import NOTHING
from phalanx.reconcile.environment import resolve_launch
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.pass_values import Context, Decision, Memory, concluded, finish
from phalanx.reconcile.stages.draft import Draft
from phalanx.reconcile.status import PhaseView


def unplannable_spec(draft: Draft) -> Draft | Decision:
    """How the workers are launched; a spec that cannot have spares fails a job that never trained
    (``invalid``) and is trained on without them by one that did (an edit never freezes it)."""
    context, memory = draft.context, draft.memory
    launch = resolve_launch(context.spec)
    refusal = desired.spares_refusal(context.spec, launch) if context.spec.workers.spares else ""
    trained = memory.start_time is not None or any(pod.active for pod in context.observed.workers())
    if refusal and not trained:
        return invalid(context, memory, str(PlanningError("spec.workers.spares", refusal)))
    if refusal:  # made impossible mid-run (an edit): train on without spares, not frozen as ``invalid``
        context = replace(context, job=without_spares(context.job))
    # replica groups restart by recreating a group's pods: each group's world has a rendezvous id
    # of its own, which moving pods to a new attempt in place would not keep
    in_place = launch.supervised and context.spec.replica_groups is None
    return replace(draft, context=replace(context, in_place=in_place), resolved=launch, refusal=refusal)


def invalid(context: Context, memory: Memory, message: str) -> Decision:
    """A spec this operator cannot plan: never kill a running job for it (a later operator version
    may not plan an older spec); a job that runs nothing fails."""
    if any(pod.active for pod in context.observed.workers()):
        previous = context.job.status
        view = PhaseView(previous.phase or "Running", previous.reason or "InvalidSpec", previous.message or message)
        return Decision(view, memory, stall=("InvalidSpec", message))
    return concluded(NOTHING, finish(context, memory, "Failed", "InvalidSpec", message))


def without_spares(job: api.TrainingJob) -> api.TrainingJob:
    """The job as planned when its spec can no longer have spares: its spare pods go, and no new one comes."""
    workers = job.spec.workers.model_copy(update={"spares": 0})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"workers": workers})})
