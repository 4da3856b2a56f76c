"""What the operator does with the API server's refusals to create a child.

A refusal that may pass on its own (a quota, missing permission, a name held by another owner, a
gang scheduler API not installed) is remembered per job and child (``RefusalMemory``) for the
planner, which paces the retries and explains them in status; one that no retry can fix
(validation, Pod Security, a webhook) fails the job (``passing_refusal`` tells them apart).
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime

from phalanx.cluster.client import ApiError
from phalanx.reconcile.observed import ChildKey, Refusal

RBAC_REFUSAL = re.compile(r'is forbidden: User "[^"]*" cannot ')
# The OwnerReferencesPermissionEnforcement admission plugin (kube-apiserver's
# plugin/pkg/admission/gc, on in OpenShift): what it refuses, and the permission that is missing.
OWNER_REFERENCE_REFUSALS = (
    (
        "cannot set blockOwnerDeletion if an ownerReference refers to a resource you can't set finalizers on",
        "update on trainingjobs/finalizers (phalanx.dev)",
    ),
    ("cannot set an ownerRef on a resource you can't delete", "delete on the child's resource"),
)
# The same plugin before its discovery knows the owner's kind (an API server restarted a moment ago,
# a CRD just installed): it cannot map TrainingJob to a resource, and says so as a 403.
OWNER_KIND_UNKNOWN = "cannot find RESTMapping for APIVersion"


def _missing_owner_permission(error: ApiError) -> str | None:
    """The permission whose absence OwnerReferencesPermissionEnforcement reports, if it does."""
    if error.status != 403:
        return None
    return next((missing for words, missing in OWNER_REFERENCE_REFUSALS if words in error.message), None)


RANK_ADDRESSES_REFUSED = "RankAddressesRefused"


def passing_refusal(kind: str, error: ApiError) -> str | None:
    """The reason of a creation refusal that may pass on its own, or None if it is permanent.
    Missing permissions may pass (an administrator grants them), whether RBAC refused the request
    or an admission plugin that checks RBAC for owner references did, and so does that plugin's
    not knowing the owner's kind yet. The ranks' EndpointSlices never fail a job, whatever refused
    them (an address the API server does not take, a policy): rank addresses only order the ranks,
    and each worker falls back to its pod IP (docs/placement.md); status says why they are missing."""
    if kind == "EndpointSlice" and error.status in (400, 403, 422):
        return RANK_ADDRESSES_REFUSED
    if error.status == 403 and "exceeded quota" in error.message:
        return "QuotaExceeded"
    if error.status == 403 and (RBAC_REFUSAL.search(error.message) or _missing_owner_permission(error)):
        return "OperatorForbidden"
    if error.status == 403 and OWNER_KIND_UNKNOWN in error.message:
        return "OwnerKindNotDiscovered"
    if error.status == 404:
        return "GangSchedulerUnavailable" if kind == "PodGroup" else "NotFound"
    if error.status in (422, 403, 400):
        return None
    return "Refused"


def refusal_message(error: ApiError) -> str:
    """What status says of a passing refusal: the API server's words, and for an owner-reference
    refusal the permission to grant (the API server names none)."""
    missing = _missing_owner_permission(error)
    if missing is None:
        return error.message
    return (
        f"{error.message} (the operator lacks {missing}, which the OwnerReferencesPermissionEnforcement "
        "admission plugin requires to set the owner reference; the chart's RBAC rules grant it)"
    )


class RefusalMemory:
    """What the API server last refused to create, by job UID and child (kind and name: the store's
    Service and pod share a name, and creating one must not clear the other's refusal), for the
    planner; and, per job, how many creations passed since its last refusal: the slow start of its
    retries (``batch``)."""

    def __init__(self) -> None:
        self._refusals: dict[str, dict[ChildKey, Refusal]] = {}
        self._jobs: dict[str, tuple[str, str]] = {}
        self._passed: dict[str, int] = {}  # job UID -> creations that passed since its last refusal

    def record(
        self, job_uid: str, key: tuple[str, str], child: ChildKey, reason: str, message: str, now: datetime
    ) -> None:
        known = self._refusals.setdefault(job_uid, {}).get(child)
        self._jobs[job_uid] = key
        self._passed[job_uid] = 0
        if known is not None and known.reason == reason:
            # after a freed quota the pauses start short again: the quota controller may lag
            attempts = 1 if known.retry_now else known.attempts + 1
            refusal = Refusal(reason, message, known.first, now, attempts)
        else:
            refusal = Refusal(reason, message, now, now)
        self._refusals[job_uid][child] = refusal

    def clear(self, job_uid: str, child: ChildKey) -> None:
        """A creation passed (or found its object)."""
        refusals = self._refusals.get(job_uid)
        if refusals is None:
            return
        refusals.pop(child, None)
        self._passed[job_uid] = self._passed.get(job_uid, 0) + 1
        if not refusals:
            self._refusals.pop(job_uid, None)
            self._jobs.pop(job_uid, None)
            self._passed.pop(job_uid, None)

    def of(self, job_uid: str) -> dict[ChildKey, Refusal]:
        return dict(self._refusals.get(job_uid, {}))

    def batch(self, job_uid: str) -> int:
        """How many pods the job's next pass may create while some are refused: one probe after a
        refusal, then twice as many each time they pass (1, 2, 4, ...: the Job controller's slow
        start), so a blocked job costs one request per retry, not one per pod."""
        return self._passed.get(job_uid, 0) + 1

    def forget_job(self, key: tuple[str, str]) -> None:
        for job_uid in [uid for uid, known in self._jobs.items() if known == key]:
            self._refusals.pop(job_uid, None)
            self._jobs.pop(job_uid, None)
            self._passed.pop(job_uid, None)

    def quota_freed(self, namespace: str) -> list[tuple[str, str]]:
        """A pod in ``namespace`` went away: jobs refused by a quota there may try their probe without
        waiting out a long pause (the planner still keeps the first pause between two probes, so a
        namespace's churn cannot make a job hammer). Returns the jobs to wake, once each."""
        woken = []
        for job_uid, refusals in self._refusals.items():
            key = self._jobs[job_uid]
            if key[0] != namespace:
                continue
            waiting = False
            for name, refusal in list(refusals.items()):
                if refusal.reason == "QuotaExceeded" and not refusal.retry_now:
                    refusals[name] = dataclasses.replace(refusal, retry_now=True)
                    waiting = True
            if waiting:
                woken.append(key)
        return woken
