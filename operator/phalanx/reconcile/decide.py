"""The planner's decision for one pass: pure, a function of (spec, observed children, remembered
state, now).

``decide`` passes one immutable ``Draft`` through ``STAGES``, in order of precedence: each stage
(a module of ``reconcile.stages``) returns a changed draft for the next, or the ``Decision`` that
ends the pass. The tuple below IS the precedence list, a comment on each entry. A spec that cannot
be planned at any stage (a ``PlanningError``) ends the pass as ``unplannable_spec.invalid``.

The decisions the stages call live in ``restarts`` (failures, gang restarts, hangs), ``phase``
(scaling and the phase), ``spares`` (promotions and the spares' upkeep) and ``topology``; the
values they pass in ``pass_values``. Nothing mutates shared state: a decision that is discarded
costs nothing to undo. ``plan`` renders the result into the Plan and the next status.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from phalanx.api import v1alpha1 as api
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.observed import Observed
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.stages.completion_and_deadline import completion_and_deadline
from phalanx.reconcile.stages.desired_objects import desired_objects
from phalanx.reconcile.stages.desired_shape import desired_shape
from phalanx.reconcile.stages.draft import Draft, Stage
from phalanx.reconcile.stages.failures_and_hangs import failures_and_hangs
from phalanx.reconcile.stages.finished import finished
from phalanx.reconcile.stages.held_back import held_back
from phalanx.reconcile.stages.job_objects import job_objects
from phalanx.reconcile.stages.missing_apis import missing_apis
from phalanx.reconcile.stages.nodes_and_stale_pods import nodes_and_stale_pods
from phalanx.reconcile.stages.placement import placement
from phalanx.reconcile.stages.remembered_state import remembered_state
from phalanx.reconcile.stages.spare_upkeep import spare_upkeep
from phalanx.reconcile.stages.suspension import suspension
from phalanx.reconcile.stages.unplannable_spec import invalid, unplannable_spec
from phalanx.reconcile.stages.workers_phase import workers_phase
from phalanx.reconcile.status import TERMINAL

STAGES: tuple[Stage, ...] = (
    finished,  # a finished job winds down and waits for its TTL
    unplannable_spec,  # how workers launch; a spec that cannot be planned stalls or fails the job
    remembered_state,  # avoided nodes whose time passed dropped; steps recomputed after a restart counted
    job_objects,  # the store, the PodGroup (node-capacity stamp), the Services, the claim template
    suspension,  # suspension stops every pod; resumption starts a new attempt
    nodes_and_stale_pods,  # pods on lost nodes forced; old attempts' pods go, but those kept in place
    completion_and_deadline,  # completed training succeeds; the active deadline fails the job
    failures_and_hangs,  # failures fail the job, replace workers or restart the gang; a hang restarts it
    missing_apis,  # a PodGroup or device-claim API that is not served holds the job Pending
    placement,  # the topology domain; no domain that can hold the gang holds it Pending
    desired_objects,  # the claim template, PodGroup, NetworkPolicy, Services and store to write
    held_back,  # an old store, the backoff, pods to move, old workers, a missing PodGroup, a Kueue resize
    desired_shape,  # the worker slots: empty ones filled (spares first), the surplus removed
    spare_upkeep,  # failed and extra spares removed, missing ones created
    workers_phase,  # rank addresses, the writes, and the phase from the workers' progress
)


def decide(job: api.TrainingJob, observed: Observed, now: datetime) -> Decision:
    """Everything one pass decides: the draft through ``STAGES`` until one decides."""
    draft = Draft.of(job, observed, now)
    try:
        for stage in STAGES:
            outcome = stage(draft)
            if isinstance(outcome, Decision):
                break
            draft = outcome
        else:
            raise AssertionError("workers_phase always decides")
    except PlanningError as error:
        start = Draft.of(job, observed, now)
        return invalid(start.context, start.memory, str(error))
    if draft.resolved is None:  # finished, or a spec that cannot be planned: as decided
        return outcome
    return recording_removals(draft, noting_refusal(draft, outcome))


def noting_refusal(draft: Draft, decision: Decision) -> Decision:
    """A job trained on without the spares its spec can no longer have says so in ``Stalled``."""
    if draft.refusal and decision.stall is None and decision.view.phase not in TERMINAL:
        stall = ("InvalidSpec", f"spec.workers.spares: {draft.refusal}; training on without spares")
        return replace(decision, stall=stall, restart_mode=draft.launch.restart_mode)
    return replace(decision, restart_mode=draft.launch.restart_mode)


def recording_removals(draft: Draft, decision: Decision) -> Decision:
    """The workers of the attempt that this pass deletes while the job goes on (a scale-down's
    surplus, a moved gang's unplaced pods) recorded in status, which is written before any
    deletion: a pod stopping or gone for the operator's own reasons is never taken for one deleted
    from outside (``handle_failures``), whatever happens to the operator in between. Failures are
    recorded as counted instead, and pods of older attempts are told apart by their attempt."""
    memory = decision.memory
    if decision.view.phase in (*TERMINAL, "Suspended"):
        return decision  # nothing of the attempt goes on
    deleted = {deletion.name for deletion in decision.actions.delete if deletion.kind == "Pod"}
    removed = [
        pod
        for pod in draft.context.observed.workers()
        if pod.name in deleted
        and pod.attempt == memory.attempt
        and not pod.deleting  # already on its way: forced now, not deleted by this pass
        and not memory.already_counted(pod)
    ]
    return replace(decision, memory=memory.removing(removed)) if removed else decision
