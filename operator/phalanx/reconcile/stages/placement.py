"""Stage: the topology domain the workers are placed in."""

from __future__ import annotations

from dataclasses import replace

from phalanx.reconcile import topology
from phalanx.reconcile.actions import event
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.stages.draft import Draft
from phalanx.reconcile.status import PhaseView


def placement(draft: Draft) -> Draft | Decision:
    """The domain the workers go to (``topology.place``): unplaced pods pinned to another one go,
    and a job with no active worker and no domain that can hold it waits."""
    context, memory, actions, current = draft.context, draft.memory, draft.actions, draft.current
    spec = context.spec
    placed = topology.place(context, memory, draft.launch, list(current))
    if placed.room is not None and placed.domain != memory.domain and spec.placement and spec.placement.topology:
        actions += event("Normal", "Placed", topology.placed_message(spec.placement.topology.key, placed))
    memory = replace(memory, domain=placed.domain)
    if placed.domain is not None:
        # unplaced pods pinned to another domain (the gang moved; again after a SIGKILL between the
        # status that recorded the move and their deletion) go, and come back in this one (not a restart)
        actions += context.removing(
            pod for pod in current if pod.active and not pod.node_name and pod.domain not in (None, placed.domain)
        )
    if placed.stall is not None and not any(pod.active for pod in current):
        reason, message = placed.stall
        return Decision(PhaseView("Pending", reason, message), memory, actions, stall=placed.stall)
    return replace(draft, memory=memory, actions=actions)
