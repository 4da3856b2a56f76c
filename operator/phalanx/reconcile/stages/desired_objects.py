"""Stage: the job's objects to write, before any worker."""

from __future__ import annotations

from dataclasses import replace

from phalanx.reconcile import desired
from phalanx.reconcile.creation import Wanted
from phalanx.reconcile.observed import child_kind
from phalanx.reconcile.pass_values import Decision
from phalanx.reconcile.stages.draft import Draft


def desired_objects(draft: Draft) -> Draft | Decision:
    """The claim template when missing, the PodGroup, NetworkPolicy and Services, and the store
    when the job has none."""
    context, children = draft.context, draft.children
    job, observed, devices = context.job, context.observed, children.device_claim_template
    # the claim template never changes (gpus and network are immutable): created when missing
    # (again if someone deletes it), never applied over (the API server refuses changes to its spec)
    devices_missing = devices is not None and not observed.has(
        child_kind(devices["apiVersion"], devices["kind"]), devices["metadata"]["name"]
    )
    wanted = [Wanted(devices, create_only=True)] if devices is not None and devices_missing else []
    wanted += [
        Wanted(obj) for obj in (children.pod_group, children.network_policy, *children.services) if obj is not None
    ]
    if observed.store() is None:
        wanted.append(Wanted(children.store, create_only=True))
        # Workers only once the job's own store exists: a store it never had is not lost, and
        # workers must not dial a name a predecessor's store still holds. A spec whose workers
        # cannot be planned fails before anything is created.
        desired.worker_pod(job, draft.launch, index=0, attempt=draft.memory.attempt)
    return replace(draft, wanted=draft.wanted + tuple(wanted), devices_missing=devices_missing)
