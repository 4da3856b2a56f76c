"""Which creation refusals may pass (and what status says of them), in the API server's own words
(the real API server says them in tests/integration/test_chart.py's OwnerReferencesPermissionEnforcement test)."""

from __future__ import annotations

import pytest

from phalanx.cluster.client import ApiError
from phalanx.cluster.refusals import passing_refusal, refusal_message

# kube-apiserver's plugin/pkg/admission/gc: admission.NewForbidden(attributes, fmt.Errorf(...))
BLOCK_OWNER_DELETION = (
    'pods "train-worker-0" is forbidden: cannot set blockOwnerDeletion if an ownerReference refers to a '
    "resource you can't set finalizers on: , <nil>"
)
OWNER_REFERENCE = 'services "train-rdzv" is forbidden: cannot set an ownerRef on a resource you can\'t delete: , <nil>'
# the same plugin right after an API server restart, before its discovery has the CRD (seen in the chaos tier)
OWNER_KIND_UNKNOWN = (
    'pods "job-002-becd-worker-1" is forbidden: cannot set blockOwnerDeletion in this case because cannot find '
    'RESTMapping for APIVersion phalanx.dev/v1alpha1 Kind TrainingJob: no matches for kind "TrainingJob" in '
    'version "phalanx.dev/v1alpha1"'
)
RBAC = (
    'pods is forbidden: User "system:serviceaccount:ops:phalanx" cannot create resource "pods" in API group "" '
    'in the namespace "team-a"'
)


@pytest.mark.parametrize(
    ("kind", "status", "message", "reason"),
    [
        ("Pod", 403, BLOCK_OWNER_DELETION, "OperatorForbidden"),
        ("Service", 403, OWNER_REFERENCE, "OperatorForbidden"),
        ("Pod", 403, RBAC, "OperatorForbidden"),
        ("Pod", 403, OWNER_KIND_UNKNOWN, "OwnerKindNotDiscovered"),
        ("Pod", 403, 'pods "w" is forbidden: exceeded quota: gpus, requested: nvidia.com/gpu=8', "QuotaExceeded"),
        ("Pod", 403, 'pods "w" is forbidden: violates PodSecurity "restricted:latest"', None),
        ("Pod", 422, 'Pod "w" is invalid: spec.containers[0].image: Required value', None),
    ],
)
def test_missing_permissions_may_pass_and_policy_refusals_fail(
    kind: str, status: int, message: str, reason: str | None
) -> None:
    assert passing_refusal(kind, ApiError(status, "Forbidden", message)) == reason


def test_an_owner_reference_refusal_names_the_permission_to_grant() -> None:
    finalizers = refusal_message(ApiError(403, "Forbidden", BLOCK_OWNER_DELETION))
    assert finalizers.startswith(BLOCK_OWNER_DELETION)
    assert "update on trainingjobs/finalizers" in finalizers
    assert "OwnerReferencesPermissionEnforcement" in finalizers
    assert "delete on the child's resource" in refusal_message(ApiError(403, "Forbidden", OWNER_REFERENCE))
    assert refusal_message(ApiError(403, "Forbidden", RBAC)) == RBAC  # RBAC's own words say it all
