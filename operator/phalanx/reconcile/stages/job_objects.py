"""Stage: the job's own objects (the rendezvous store pod, the PodGroup, the Services, the DRA claim
template), planned before anything else so that a spec that cannot have them fails first."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from phalanx.reconcile import desired, naming
from phalanx.reconcile.actions import NOTHING, Actions, requeue
from phalanx.reconcile.observed import child_kind
from phalanx.reconcile.pass_values import Context, Decision
from phalanx.reconcile.stages.draft import Draft
from phalanx.reconcile.status import format_time

NODE_CAPACITY_STAMP_SECONDS = 10.0
"""Least time between two new node-capacity stamps on one waiting PodGroup: pods leave the cluster
all the time, and each would otherwise cost every waiting gang a PodGroup write."""


def job_objects(draft: Draft) -> Draft | Decision:
    """What the job should have besides its workers: the store, the PodGroup (with the nodes'
    capacity while a worker waits for one), the Services and the claim template."""
    context = draft.context
    stamp, actions = node_capacity_stamp(context)
    # the store is created only in a pass that handles no failure, so the nodes avoided so far are all there are
    children = desired.job_children(
        context.job,
        draft.launch,
        avoid=context.avoided_nodes(draft.memory),
        node_capacity=stamp,
        isolation=context.observed.isolation,
    )
    return replace(draft, actions=draft.actions + actions, built=children)


def node_capacity_stamp(context: Context) -> tuple[str | None, Actions]:
    """What the coscheduling PodGroup carries in ``phalanx.dev/node-capacity``: while a worker
    waits for a node it follows the nodes, so that new capacity updates the PodGroup and the
    scheduler tries the gang again at once; otherwise it stays as it was (no needless writes)."""
    job, observed, now = context.job, context.observed, context.now
    if job.spec.gang.scheduler != "scheduler-plugins":
        return None, NOTHING
    kind = child_kind(desired.COSCHEDULING_API, "PodGroup")
    record = observed.objects.get((kind, naming.pod_group_name(job.metadata.name)))
    stamped = record.node_capacity if record is not None else None
    waiting = any(pod.unschedulable_message and not pod.deleting for pod in observed.workers())
    capacity_now = observed.node_capacity
    if not waiting or not capacity_now:
        return stamped, NOTHING
    # "<fingerprint>@<time>": a new stamp at most every NODE_CAPACITY_STAMP_SECONDS per job
    if (stamped or "").partition("@")[0] == capacity_now:
        return stamped, NOTHING
    last = record.node_capacity_at if record is not None else None
    due = last + timedelta(seconds=NODE_CAPACITY_STAMP_SECONDS) if last is not None else now
    if due > now:
        return stamped, requeue((due - now).total_seconds())
    return f"{capacity_now}@{format_time(now)}", NOTHING
