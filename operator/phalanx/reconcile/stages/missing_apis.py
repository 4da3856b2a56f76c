"""Stage: a job whose PodGroups or device claims have no API served waits for it."""

from __future__ import annotations

from phalanx.reconcile.desired import Object
from phalanx.reconcile.pass_values import Context, Decision
from phalanx.reconcile.stages.draft import Draft
from phalanx.reconcile.status import PhaseView


def missing_apis(draft: Draft) -> Draft | Decision:
    """The job waits, Pending and stalled, while an API its objects need is missing."""
    unavailable = missing_api(draft.context, draft.children.pod_group, draft.children.device_claim_template)
    if unavailable is None:
        return draft
    reason, message = unavailable
    return Decision(PhaseView("Pending", reason, message), draft.memory, draft.actions, stall=(reason, message))


def missing_api(context: Context, group: Object | None, devices: Object | None) -> tuple[str, str] | None:
    """Why the job cannot start because an API it needs is not served or not permitted (reason,
    message), or None: the gang scheduler's PodGroups, the ResourceClaimTemplates of DRA devices."""
    missing, spec = context.observed.missing_apis, context.job.spec
    if group is not None and group["apiVersion"] in missing:
        why = missing[group["apiVersion"]]
        return "GangSchedulerUnavailable", (
            f"gang.scheduler is {spec.gang.scheduler}, but PodGroups ({group['apiVersion']}) are {why}: "
            f"install {spec.gang.scheduler} or set gang.scheduler to none; the job starts once the API is there"
        )
    if devices is not None and devices["apiVersion"] in missing:
        why = missing[devices["apiVersion"]]
        return "DevicesUnavailable", (
            f"the job asks for DRA devices (gpus.deviceClassName or network.rdma.deviceClassName), but "
            f"ResourceClaimTemplates ({devices['apiVersion']}) are {why}: DRA needs Kubernetes 1.34 or later "
            "(or ask for GPUs by gpus.resource); the job starts once the API is there"
        )
    return None
