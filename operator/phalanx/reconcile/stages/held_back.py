"""Stage: what holds the workers back: an old store stopping, the restart backoff, workers kept
through an in-place restart to move, old workers stopping, a missing PodGroup or claim template,
a Kueue group to resize."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from phalanx.reconcile import creation, restarts, spares, topology
from phalanx.reconcile.actions import NOTHING, Actions, requeue
from phalanx.reconcile.creation import Wanted
from phalanx.reconcile.observed import PodRecord, child_kind
from phalanx.reconcile.pass_values import Context, Decision
from phalanx.reconcile.restarts import gang_restart, kueue_group_resized
from phalanx.reconcile.stages.draft import Draft
from phalanx.reconcile.status import PhaseView, format_time


def held_back(draft: Draft) -> Draft | Decision:
    """The pass ends before the workers while something they need is not there yet; an empty slot
    is still filled by promoting a ready spare while old workers stop (its name is its own)."""
    context, memory, current = draft.context, draft.memory, list(draft.current)
    observed, spec, group = context.observed, context.spec, draft.children.pod_group
    store_pod = observed.store()
    if store_pod is not None and (store_pod.deleting or memory.already_counted(store_pod)):
        # Workers that dialled the old store would lose it again as it goes.
        return held(draft, PhaseView("Restarting", "GangRestart", "waiting for the old rendezvous store to stop"))
    not_before = memory.restart_not_before
    if not_before is not None and not_before > context.now:
        return held(
            draft,
            PhaseView("Restarting", "Backoff", f"attempt {memory.attempt} starts at {format_time(not_before)}"),
            more=requeue((not_before - context.now).total_seconds()),
        )
    if draft.moving:
        # after the backoff and once an old store is gone (above): the moved pods' processes restart
        # at once and dial the attempt's store, which the launchers wait for if it is still starting
        moving = list(draft.moving)
        message = f"restarting {len(moving)} worker(s) in place as attempt {memory.attempt}"
        leaving = [pod for pod in draft.stale if pod not in moving]
        if leaving:
            message += "; " + old_workers_message(context, leaving)
        # the new attempt's rank addresses with the move, so the restarted agents need not wait a pass
        ranks_slices, addresses = topology.rank_addresses(context, memory, draft.launch, moving)
        return held(
            replace(draft, wanted=draft.wanted + tuple(Wanted(obj) for obj in ranks_slices)),
            PhaseView("Restarting", "GangRestart", message),
            more=restarts.moving(context, moving, memory.attempt) + addresses,
        )
    active = sum(1 for pod in current if pod.active)
    if draft.stale and active < spec.workers.min:
        # a spare takes its slot now: its name is its own, so it need not wait for the old pod to go
        filled = spares.promotions(context, memory, current)
        return held(
            draft,
            PhaseView("Restarting", "GangRestart", old_workers_message(context, draft.stale)),
            more=filled.actions,
            promoted=filled.promoted,
        )
    # old workers still stopping hold nothing back once at least min workers of the attempt run
    # (a world re-formed in place trains on): a new pod for a slot waits for its old pod's name
    if group is not None and not observed.has(
        child_kind(group["apiVersion"], group["kind"]), group["metadata"]["name"]
    ):
        return held(draft, PhaseView("Pending", "WaitingForPodGroup", "waiting for the PodGroup to exist"))
    if draft.devices_missing:
        # a worker whose claim template is missing would wait unschedulable without a word of why
        return held(
            draft,
            PhaseView(
                "Pending", "WaitingForDeviceClaims", "waiting for the ResourceClaimTemplate of the workers' devices"
            ),
        )
    resized = kueue_group_resized(context, current)
    if resized is not None:
        restart = gang_restart(context, memory, current, [], store_lost=False, cause=resized)
        assert restart.view is not None
        return held(replace(draft, memory=restart.memory), restart.view, more=restart.actions)
    return draft


def held(
    draft: Draft,
    view: PhaseView,
    *,
    more: Actions = NOTHING,
    promoted: frozenset[str] = frozenset(),
) -> Decision:
    """The pass ends before workers: only the objects wanted so far are written; spares are
    tended (a failed one recorded, extra ones removed) but none is created."""
    context = draft.context
    writes = creation.writes(draft.wanted, context.observed, context.job.metadata.uid, context.now)
    tended = spares.upkeep(context, draft.memory, draft.launch, promoted=promoted, may_create=False)
    return Decision(
        view,
        tended.memory,
        draft.actions + more + tended.actions + writes.waits,
        apply=writes.apply,
        stall=draft.stall,
    )


def old_workers_message(context: Context, stale: Sequence[PodRecord]) -> str:
    """Why the job waits for old workers, naming one on a node that is gone from under it."""
    message = f"waiting for {len(stale)} old worker(s) to stop"
    stuck = next((pod for pod in stale if pod.node_name and context.node_lost(pod) is not None), None)
    if stuck is not None:
        message += (
            f"; {stuck.name} is on node {stuck.node_name}, which {context.node_lost(stuck)}: it stops when "
            "the node comes back or is deleted (its container may still run, so it is not force-deleted)"
        )
    return message
