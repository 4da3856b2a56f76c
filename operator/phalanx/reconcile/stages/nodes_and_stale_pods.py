"""Stage: pods no kubelet can stop are force-deleted, and pods of old attempts go, except those an
in-place gang restart keeps (``Context.still_keeps``), which ``held_back`` moves to the attempt.

A pod is taken for lost with its node only when the node was deleted or has not been Ready for the
operator's grace (``NodeLoss``); a pod the taint manager evicts says so itself. A pod whose container
may still run is never force-deleted unless its node object is gone or the operator was told to."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from phalanx.reconcile import slots
from phalanx.reconcile.actions import NOTHING, Actions, requeue
from phalanx.reconcile.pass_values import Context, Decision
from phalanx.reconcile.stages.draft import Draft


def nodes_and_stale_pods(draft: Draft) -> Draft | Decision:
    """The current attempt's workers, one per slot; the rest deleted, but for those kept to be moved."""
    context, memory = draft.context, draft.memory
    actions = draft.actions + watch_nodes(context)
    workers = context.observed.workers()
    current = [pod for pod in workers if pod.attempt == memory.attempt]
    stale = [pod for pod in workers if pod.attempt != memory.attempt]
    # kept through an in-place gang restart: moved to the current attempt later, never deleted
    moving = [pod for pod in stale if (pod.attempt or 0) < memory.attempt and context.still_keeps(pod, memory)]
    actions += context.removing(pod for pod in stale if pod not in moving)
    current, duplicates = slots.one_pod_per_slot(context, current)
    return replace(
        draft,
        memory=replace(memory, claims=slots.standing(context, memory, current)),
        actions=actions + duplicates,
        current=tuple(current),
        stale=tuple(stale),
        moving=tuple(moving),
    )


def watch_nodes(context: Context) -> Actions:
    """Force-delete terminating pods no kubelet can confirm any more (``may_force_delete``), and
    come back when the grace of a not-ready node that holds an active pod of the job runs out."""
    observed, now = context.observed, context.now
    loss = observed.node_loss
    actions = NOTHING
    for pod in observed.pods:
        node = pod.node_name
        if pod.deleting and context.may_force_delete(pod):
            actions += context.removing([pod])
        if pod.active and node in observed.unready_nodes and node not in loss.deleted:
            since = loss.unready_since.get(node, now)
            remaining = (since + timedelta(seconds=loss.grace_seconds) - now).total_seconds()
            if remaining > 0:
                actions += requeue(remaining)
    return actions
