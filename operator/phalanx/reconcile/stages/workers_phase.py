"""Stage: the workers' rank addresses, the writes, and the phase from the workers' progress."""

from __future__ import annotations

from phalanx.reconcile import creation, topology
from phalanx.reconcile.creation import Wanted
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.phase import running_phase
from phalanx.reconcile.stages.draft import Draft


def workers_phase(draft: Draft) -> Draft | Decision:
    """The pass ends: rank addresses and the ranks Service written, and the phase from the workers'
    progress and from what could not be created (``running_phase``)."""
    context, memory, launch, current = draft.context, draft.memory, draft.launch, list(draft.current)
    job, observed = context.job, context.observed
    ranks_slices, addresses = topology.rank_addresses(context, memory, launch, current)
    ranks = tuple(Wanted(obj) for obj in (draft.children.ranks_service, *ranks_slices) if obj is not None)
    writes = creation.writes(draft.wanted + ranks, observed, job.metadata.uid, context.now)
    step = running_phase(context, memory, launch, current, observed.store(), writes.blocked)
    assert step.view is not None
    return Decision(
        step.view,
        step.memory,
        draft.actions + addresses + step.actions + writes.waits,
        apply=writes.apply,
        stall=step.stall or draft.stall,
        rescaled=draft.scaled.rescaled if draft.scaled is not None else None,
    )
